//! The sizes of the manager's internal tables, for programs (and soaks)
//! that watch them stay flat while they run.

use super::MemoryManager;

/// How many entries the manager's internal tables hold now
/// ([`MemoryManager::table_sizes`]). Each is bounded: a program that makes
/// and drops threads and streams forever keeps them flat.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableSizes {
    /// Streams the devices' stream registries hold (streams blocks were
    /// freed on, kept while a block may still wait for them).
    pub streams_live: usize,
    /// Ids of streams the registries let go, remembered so that blocks
    /// freed on them need no wait (bounded, oldest forgotten first).
    pub streams_retired: usize,
}

impl MemoryManager {
    /// The sizes of the internal tables now (one lock each, no driver call).
    pub fn table_sizes(&self) -> TableSizes {
        let mut t = TableSizes::default();
        for d in self.initialised_devices() {
            let (live, retired) = d.stream_table_sizes();
            t.streams_live += live;
            t.streams_retired += retired;
        }
        t
    }
}
