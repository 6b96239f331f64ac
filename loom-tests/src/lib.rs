//! Loom models of cumem.
