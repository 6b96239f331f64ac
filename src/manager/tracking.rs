//! Optional allocation-site tracking: where each live allocation was made,
//! for the shutdown report. Off by default (capturing a backtrace per
//! allocation costs microseconds).

use std::collections::HashMap;

use crate::error::PoolKind;
use crate::sync::{lock, Mutex};

/// Remembers the call site of every live allocation.
#[derive(Default)]
pub(crate) struct SiteTracker {
    sites: Mutex<HashMap<(PoolKind, usize), String>>,
}

/// The first frame of the current backtrace outside cumem, its allocator
/// plumbing and the standard library: the caller's function and line.
fn call_site() -> String {
    let bt = std::backtrace::Backtrace::force_capture().to_string();
    let mut lines = bt.lines().map(str::trim);
    while let Some(line) = lines.next() {
        let Some((_, func)) = line.split_once(": ") else { continue };
        let internal = [
            "cumem::",
            "<cumem::",
            "std::",
            "core::",
            "alloc::",
            "<alloc::",
            "allocator_api2::",
            "<allocator_api2::",
            "hashbrown::",
            "__rustc",
            "<core::",
            "<std::",
        ]
        .iter()
        .any(|p| func.starts_with(p));
        if internal || !line.chars().next().is_some_and(|c| c.is_ascii_digit()) {
            continue;
        }
        let at = lines.next().and_then(|l| l.strip_prefix("at ")).unwrap_or("?");
        return format!("{func} at {at}");
    }
    "unknown (no symbols)".to_string()
}

impl SiteTracker {
    pub(crate) fn record(&self, kind: PoolKind, addr: usize) {
        let site = call_site();
        lock(&self.sites).insert((kind, addr), site);
    }

    pub(crate) fn forget(&self, kind: PoolKind, addr: usize) {
        lock(&self.sites).remove(&(kind, addr));
    }

    pub(crate) fn site(&self, kind: PoolKind, addr: usize) -> Option<String> {
        lock(&self.sites).get(&(kind, addr)).cloned()
    }
}
