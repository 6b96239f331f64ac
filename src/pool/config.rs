//! [`PoolConfig`]: how a pool grows, how large it may get, and which of
//! its parts (thread caches, page remapping, the hot block) are on.

#[cfg(doc)]
use super::{Pool, MAX_CACHED_BLOCK};
use crate::error::PoolKind;

/// The largest alignment a pool honours.
pub const MAX_ALIGN: usize = 1 << 21;

/// The default of [`PoolConfig::remap_slack_ppm`]: 1 %.
pub const DEFAULT_REMAP_SLACK_PPM: u32 = 10_000;

/// How a pool grows and how large it may get.
///
/// # Examples
/// See [`Pool`].
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Which pool this is (named in errors).
    pub kind: PoolKind,
    /// Bytes reserved by the first allocation, as one chunk (0: none beyond
    /// the first request's chunk).
    pub initial_size: usize,
    /// The smallest chunk asked of the upstream when the pool grows.
    pub min_chunk: usize,
    /// The most the pool may reserve (`None`: no limit but the upstream's).
    pub max_size: Option<usize>,
    /// Grow by extending the highest chunk in place when the upstream can
    /// (expandable segments), so new memory coalesces with the old tail.
    pub expandable: bool,
    /// Keep per-thread caches of freed blocks (see the module docs): with
    /// it, requests up to [`MAX_CACHED_BLOCK`] are rounded up to a size
    /// class (at most 6.25 % more), and most allocations and frees skip the
    /// pool's lock.
    pub thread_cache: bool,
    /// The thread caches wait for contention: they start serving once
    /// allocations wait for the pool's lock again and again
    /// ([`WAITS_TO_SERVE`](super::WAITS_TO_SERVE) waits within
    /// [`WAIT_WINDOW_MS`](super::WAIT_WINDOW_MS)), and serve from then
    /// on. Until then the pool is exactly one best fit, with no memory
    /// parked per thread. The device pools use it.
    pub cache_when_contended: bool,
    /// The most bytes one thread's cache of this pool holds (0: no caches).
    pub thread_cache_bytes: usize,
    /// Thread caches hit only on the exact (256 B-rounded) size and round
    /// nothing up to a class: no fragmentation of their own, fewer hits
    /// when sizes vary. The device pools use it.
    pub cache_exact: bool,
    /// Never give free chunks back to the upstream to retry a failed
    /// allocation: only an explicit [`Pool::release_cached`] or
    /// [`Pool::shutdown`] does. For memory that work recorded earlier (a
    /// CUDA graph) may still use while its blocks look free.
    pub keep_chunks: bool,
    /// With page remapping, how far physical memory may rise above the
    /// page floor of the pool's own placement before memory moves instead
    /// of new memory being mapped, in millionths (10 000: 1 %). See
    /// `remap.rs`: less slack means less memory and more remapping.
    pub remap_slack_ppm: u32,
    /// Keep the block freed last *hot*: not coalesced until the next
    /// operation, so that an allocation of exactly its size right after
    /// takes it back with no index work where best fit would place it
    /// anyway (a hot allocate + free pair of one size then splits and
    /// merges nothing; see `best_fit.rs`). Placement is best fit's either
    /// way. The device pools use it
    /// ([`Config::hot_block`](crate::Config::hot_block)).
    pub hot_block: bool,
}

impl PoolConfig {
    /// Defaults for a pool of this kind: no initial reservation, 2 MiB
    /// minimum chunks, no limit, expandable growth where the upstream
    /// supports it, thread caches of 256 MiB (per thread).
    pub fn new(kind: PoolKind) -> Self {
        PoolConfig {
            kind,
            initial_size: 0,
            min_chunk: 2 << 20,
            max_size: None,
            expandable: true,
            thread_cache: true,
            thread_cache_bytes: 256 << 20,
            cache_exact: false,
            cache_when_contended: false,
            keep_chunks: false,
            remap_slack_ppm: DEFAULT_REMAP_SLACK_PPM,
            hot_block: false,
        }
    }
}
