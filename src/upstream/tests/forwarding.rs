//! For tests: a leaf upstream that records which of its methods were
//! called, and a check that a wrapper passes every method through.

use std::collections::BTreeSet;

use crate::error::Result;
use crate::sync::{lock, Arc, Mutex};
use crate::upstream::{Chunk, Upstream};

/// Says yes to everything and records each call by method name.
#[derive(Default)]
pub(crate) struct Recorder {
    calls: Arc<Mutex<BTreeSet<&'static str>>>,
}

impl Recorder {
    fn saw(&self, method: &'static str) {
        lock(&self.calls).insert(method);
    }
}

const PAGE: usize = 1 << 21;

impl Upstream for Recorder {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        self.saw("allocate_chunk");
        Ok(Chunk { addr: 1 << 40, size })
    }
    fn deallocate_chunk(&self, _: Chunk) -> Result<()> {
        self.saw("deallocate_chunk");
        Ok(())
    }
    fn try_extend(&self, _: Chunk, _: usize) -> Result<bool> {
        self.saw("try_extend");
        Ok(true)
    }
    fn can_extend(&self) -> bool {
        self.saw("can_extend");
        true
    }
    fn try_shrink(&self, _: Chunk, _: usize) -> Result<bool> {
        self.saw("try_shrink");
        Ok(true)
    }
    fn granularity(&self) -> usize {
        self.saw("granularity");
        PAGE
    }
    fn name(&self) -> &'static str {
        self.saw("name");
        "recorder"
    }
    fn host_accessible(&self) -> bool {
        self.saw("host_accessible");
        true
    }
    fn device_free(&self) -> Option<usize> {
        self.saw("device_free");
        Some(1)
    }
    fn can_remap(&self) -> bool {
        self.saw("can_remap");
        true
    }
    fn reserve_chunk(&self, size: usize) -> Result<Chunk> {
        self.saw("reserve_chunk");
        Ok(Chunk { addr: 1 << 41, size })
    }
    fn try_extend_reserved(&self, _: Chunk, _: usize) -> Result<bool> {
        self.saw("try_extend_reserved");
        Ok(true)
    }
    fn map_runs(&self, _: &[Chunk]) -> Result<u64> {
        self.saw("map_runs");
        Ok(1)
    }
    fn unmap_within(&self, spans: &[Chunk], _: usize, _: bool, _: bool) -> Result<Vec<Chunk>> {
        self.saw("unmap_within");
        Ok(spans.to_vec())
    }
    fn release_kept(&self) {
        self.saw("release_kept");
    }
    fn kept(&self) -> usize {
        self.saw("kept");
        0
    }
    fn trim_kept(&self, _: usize) {
        self.saw("trim_kept");
    }
}

/// Wraps a [`Recorder`] with `wrap`, calls every [`Upstream`] method on
/// the wrapper, and returns the methods that did not reach the recorder
/// (empty when the wrapper passes everything through).
pub(crate) fn methods_not_forwarded(wrap: impl FnOnce(Box<dyn Upstream>) -> Box<dyn Upstream>) -> Vec<&'static str> {
    let recorder = Recorder::default();
    let calls = recorder.calls.clone();
    let u = wrap(Box::new(recorder));
    let c = Chunk { addr: 1 << 40, size: PAGE };
    let _ = u.allocate_chunk(PAGE);
    let _ = u.reserve_chunk(PAGE);
    let _ = (u.can_extend(), u.can_remap(), u.host_accessible(), u.granularity(), u.name(), u.device_free());
    let _ = u.try_extend(c, PAGE);
    let _ = u.try_shrink(c, PAGE);
    let _ = u.try_extend_reserved(c, PAGE);
    let _ = u.map_runs(&[c]);
    let _ = u.unmap_within(&[c], PAGE, false, true);
    u.release_kept();
    let _ = u.kept();
    u.trim_kept(0);
    let _ = u.deallocate_chunk(c);
    let seen = lock(&calls).clone();
    ALL.iter().copied().filter(|m| !seen.contains(m)).collect()
}

/// Every method of [`Upstream`] but `inner` (a wrapper's own).
const ALL: [&str; 17] = [
    "allocate_chunk",
    "deallocate_chunk",
    "try_extend",
    "can_extend",
    "try_shrink",
    "granularity",
    "name",
    "host_accessible",
    "device_free",
    "can_remap",
    "reserve_chunk",
    "try_extend_reserved",
    "map_runs",
    "unmap_within",
    "release_kept",
    "kept",
    "trim_kept",
];

#[cfg(test)]
mod tests;
