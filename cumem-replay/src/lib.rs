//! The tools around cumem that a program using the allocator does not
//! need: reading allocation traces (RMM's log CSV, plain or gzip),
//! replaying them through cumem's device modes, the host fallback, a
//! simulated device and the raw driver calls, and drawing pictures (the
//! live-bytes and reserved-bytes curves of a replay, a memory snapshot's
//! segment map), and generating synthetic traces of known shapes
//! ([`synth`]). The `cumem-replay` binary puts them on the command line:
//!
//! ```text
//! cargo run --release -p cumem-replay -- --warm ../shared/traces/*.csv.gz
//! ```

pub mod replay;
pub mod snapshot_svg;
pub mod synth;
pub mod trace;

pub use snapshot_svg::snapshot_svg;
