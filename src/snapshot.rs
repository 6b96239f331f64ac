//! [`MemoryManager::memory_snapshot`]: every pool's chunks and blocks at
//! one moment, in the spirit of PyTorch's memory snapshot. The
//! `cumem-replay` crate draws it as a segment map (SVG).

use crate::manager::MemoryManager;
use crate::pool::{PoolSnapshot, PoolStats};

/// One pool of a [`MemorySnapshot`].
///
/// # Examples
/// See [`MemorySnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPicture {
    /// "pinned", "managed", "device N" or "device N tag NAME".
    pub name: String,
    /// Where its chunks come from (the upstream's name).
    pub upstream: &'static str,
    /// Its statistics, read right after the blocks.
    pub stats: PoolStats,
    /// Its chunks and blocks.
    pub snapshot: PoolSnapshot,
}

/// Every pool's chunks and blocks: the pinned pool, the managed pool once
/// used, each device's sync pool once used, and each memory tag's pool on
/// each device ("device N tag NAME"; memory of the stream-ordered modes
/// lives in the driver's pools and is not listed).
///
/// # Examples
/// ```
/// use cumem::MemoryManager;
/// let mm = MemoryManager::global()?;
/// let d = mm.allocate_device(3 << 20)?;
/// let snap = mm.memory_snapshot();
/// let device = snap.pools.iter().find(|p| p.name == "device 0").unwrap();
/// assert!(device.stats.in_use >= 3 << 20);
/// mm.free_device(d)?;
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MemorySnapshot {
    /// The pools, pinned first.
    pub pools: Vec<PoolPicture>,
}

impl MemoryManager {
    /// A snapshot of every pool's chunks and blocks (see
    /// [`MemorySnapshot`]). Each
    /// pool's lock is held only to copy its block list.
    pub fn memory_snapshot(&self) -> MemorySnapshot {
        let mut pools = Vec::new();
        let pinned = self.pinned_pool();
        pools.push(PoolPicture {
            name: "pinned".into(),
            upstream: pinned.upstream().name(),
            snapshot: pinned.snapshot(),
            stats: pinned.stats(),
        });
        if let Some(m) = self.managed_cell().0.get() {
            pools.push(PoolPicture {
                name: "managed".into(),
                upstream: m.upstream().name(),
                snapshot: m.snapshot(),
                stats: m.stats(),
            });
        }
        for d in self.initialised_devices() {
            let p = d.pool();
            pools.push(PoolPicture {
                name: format!("device {}", d.ordinal()),
                upstream: p.upstream().name(),
                snapshot: p.snapshot(),
                stats: p.stats(),
            });
            for t in d.tag_pools() {
                pools.push(PoolPicture {
                    name: format!("device {} tag {}", d.ordinal(), t.name()),
                    upstream: t.pool.upstream().name(),
                    snapshot: t.pool.snapshot(),
                    stats: t.pool.stats(),
                });
            }
        }
        MemorySnapshot { pools }
    }
}
