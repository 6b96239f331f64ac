//! Test support of the upstreams.

pub(crate) mod forwarding;
