use std::time::Instant;

use super::{Geometric, MAX_CHUNK, QUIET, RESTART};
use crate::upstream::{Host, Upstream};

const MIB: usize = 1 << 20;

#[test]
fn a_ramp_grows_by_a_quarter_and_a_quiet_spell_restarts_small() {
    let g = Geometric::new(Box::new(Host::new()), None);
    let mut chunks = Vec::new();
    // A ramp: chunks follow each other closely.
    while g.taken() < 512 * MIB {
        chunks.push(g.allocate_chunk(4 * MIB).unwrap());
    }
    let taken = g.taken();
    assert!(chunks.len() <= 32, "{} calls to reach {} MiB", chunks.len(), taken / MIB);
    let now = Instant::now();
    let quarter = (taken / 4).min(MAX_CHUNK);
    assert!(g.chunk_size_at(4 * MIB, 1, now) >= quarter.min(2 * chunks.last().unwrap().size));
    // After a quiet spell: at most RESTART, then doubling.
    let later = now + 2 * QUIET;
    assert_eq!(g.chunk_size_at(4 * MIB, 1, later), RESTART);
    assert_eq!(g.chunk_size_at(64 * MIB, 1, later), 64 * MIB, "a request is served whole");
    g.record(later, RESTART);
    assert_eq!(g.chunk_size_at(4 * MIB, 1, later), 2 * RESTART);
    for c in chunks {
        g.deallocate_chunk(c).unwrap();
    }
    assert_eq!(g.taken(), 0, "every chunk given back is counted off");
}

/// A ramp on `g` to at least 512 MiB: its chunks.
fn ramp(g: &Geometric) -> Vec<crate::upstream::Chunk> {
    let mut chunks = Vec::new();
    while g.taken() < 512 * MIB {
        chunks.push(g.allocate_chunk(4 * MIB).unwrap());
    }
    chunks
}

#[test]
fn threads_growing_at_once_split_the_extra() {
    let g = Geometric::new(Box::new(Host::new()), None);
    let chunks = ramp(&g);
    let now = Instant::now();
    let alone = g.chunk_size_at(MIB, 1, now);
    let shared = g.chunk_size_at(MIB, 4, now);
    assert!(shared < alone, "four threads asking at once each take less ({shared} B) than one ({alone} B)");
    for c in chunks {
        g.deallocate_chunk(c).unwrap();
    }
}

#[test]
fn a_limit_caps_the_extra_never_the_request() {
    let limit = 600 * MIB;
    let g = Geometric::new(Box::new(Host::new()), Some(limit));
    let chunks = ramp(&g);
    let now = Instant::now();
    // A quarter of what is taken would pass the limit.
    let extra = g.chunk_size_at(MIB, 1, now);
    assert!(g.taken() + extra <= limit, "{} B taken + {extra} B passes the limit", g.taken());
    assert_eq!(g.chunk_size_at(200 * MIB, 1, now), 200 * MIB, "a request is served whole");
    for c in chunks {
        g.deallocate_chunk(c).unwrap();
    }
}
