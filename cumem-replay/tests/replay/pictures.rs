//! Pictures of memory: pool snapshots add up to the pools' statistics, the
//! segment map and the replay plot are well-formed SVG that name what they
//! show.

use cumem::pool::{BlockState, Pool, PoolConfig, PoolSnapshot, PoolStats, StreamTag};
use cumem::upstream::Host;
use cumem::{Config, MemoryManager, PoolKind};
use cumem_replay::replay::{plot, Target};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The snapshot's blocks tile its chunks and add up to `stats`.
fn check_adds_up(snap: &PoolSnapshot, stats: &PoolStats) {
    assert_eq!(snap.chunks.len(), stats.chunks);
    assert_eq!(snap.chunks.iter().map(|c| c.size).sum::<usize>(), stats.reserved);
    assert_eq!(snap.bytes(BlockState::Live), stats.in_use, "live bytes");
    assert_eq!(snap.bytes(BlockState::Cached), stats.cached, "cached bytes");
    assert_eq!(snap.bytes(BlockState::Free), stats.reserved - stats.in_use - stats.cached, "free bytes");
    assert_eq!(snap.count(BlockState::Live), stats.live_blocks, "live blocks");
    assert_eq!(snap.count(BlockState::Free), stats.free_blocks, "free blocks");
    if stats.cached == 0 && snap.count(BlockState::Cached) == 0 {
        // Without thread caches each live block carries its own request.
        let live_requested: usize =
            snap.blocks.iter().filter(|b| b.state == BlockState::Live).map(|b| b.requested).sum();
        assert_eq!(live_requested, stats.requested, "requested bytes");
    }
    for (i, c) in snap.chunks.iter().enumerate() {
        let mut at = c.addr;
        for b in snap.blocks.iter().filter(|b| b.chunk == i) {
            assert_eq!(b.addr, at, "blocks tile chunk {i}");
            at += b.size;
        }
        assert_eq!(at, c.end(), "the blocks of chunk {i} end at its end");
    }
}

fn churn(pool: &Pool<Host>, seed: u64) -> Vec<usize> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut live = Vec::new();
    for _ in 0..4000 {
        if live.is_empty() || rng.gen_bool(0.6) {
            let size = if rng.gen_bool(0.05) { rng.gen_range(1..8 << 20) } else { rng.gen_range(1..200_000) };
            live.push(pool.allocate(size, 256).unwrap().addr);
        } else {
            let a = live.swap_remove(rng.gen_range(0..live.len()));
            let tag = if rng.gen_bool(0.3) { StreamTag { stream: 7, seq: 1 } } else { StreamTag::NONE };
            pool.deallocate(a, tag).unwrap();
        }
    }
    live
}

#[test]
fn snapshots_add_up_to_the_stats() {
    for caches in [false, true] {
        let mut config = PoolConfig::new(PoolKind::Standalone);
        config.thread_cache = caches;
        let pool = Pool::new(Host::new(), config);
        let live = churn(&pool, 11);
        let snap = pool.snapshot();
        check_adds_up(&snap, &pool.stats());
        if caches {
            assert!(snap.count(BlockState::Cached) > 0, "freed small blocks sit in this thread's cache");
        } else {
            assert_eq!(snap.count(BlockState::Cached), 0);
        }
        for a in live {
            pool.deallocate(a, StreamTag::NONE).unwrap();
        }
        check_adds_up(&pool.snapshot(), &pool.stats());
    }
}

fn element_names_and_text(svg: &str) -> (String, Vec<String>) {
    let doc = roxmltree::Document::parse(svg).expect("the SVG is well-formed XML");
    let root = doc.root_element().tag_name().name().to_string();
    let texts = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .collect();
    (root, texts)
}

#[test]
fn the_manager_snapshot_draws_every_pool() {
    let mm = MemoryManager::new(Config::new()).unwrap();
    let p = mm.allocate_pinned(5000).unwrap();
    let d: Vec<u64> = (1..40).map(|i| mm.allocate_device(i * 70_000).unwrap()).collect();
    for &x in d.iter().step_by(3) {
        mm.free_device(x).unwrap();
    }
    let m = mm.allocate_managed(12345).unwrap();
    let snap = mm.memory_snapshot();
    let names: Vec<&str> = snap.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["pinned", "managed", "device 0"]);
    for pool in &snap.pools {
        check_adds_up(&pool.snapshot, &pool.stats);
    }
    let svg = cumem_replay::snapshot_svg(&snap).unwrap();
    let (root, texts) = element_names_and_text(&svg);
    assert_eq!(root, "svg");
    for name in names {
        assert!(texts.iter().any(|t| t.starts_with(name)), "{name} is named");
    }
    std::fs::write(std::env::temp_dir().join("cumem-snapshot-test.svg"), &svg).unwrap();
    mm.free_pinned(p.as_ptr()).unwrap();
    mm.free_managed(m.as_ptr()).unwrap();
}

#[test]
fn the_replay_plot_names_every_target() {
    let mut rng = SmallRng::seed_from_u64(5);
    let mut csv = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    let mut live: Vec<u64> = Vec::new();
    let mut next = 0x1000u64;
    for i in 0..3000 {
        if live.is_empty() || rng.gen_bool(0.55) {
            let size = rng.gen_range(1..4 << 20);
            csv += &format!("0,{i},allocate,{next:#x},{size},0x0\n");
            live.push(next);
            next += 8 << 20;
        } else {
            let p = live.swap_remove(rng.gen_range(0..live.len()));
            csv += &format!("0,{i},free,{p:#x},0,0x0\n");
        }
    }
    let trace = cumem_replay::trace::parse_str(&csv).unwrap();
    let targets = [Target::Host, Target::Simulated, Target::RawCuMemAlloc];
    let (panel, skipped) = plot::panel(&trace, &targets, &Config::new(), 100);
    // The raw target has no reserved figure (and needs a GPU); it is named
    // among the skipped with a reason.
    assert!(skipped.iter().any(|s| s.contains("raw_cumemalloc")), "{skipped:?}");
    assert_eq!(panel.series.len(), 3);
    let live_peak = panel.series[0].points.iter().map(|p| p.1).max().unwrap();
    for s in &panel.series[1..] {
        let reserved_peak = s.points.iter().map(|p| p.1).max().unwrap();
        assert!(reserved_peak >= live_peak, "{}: reserved {reserved_peak} < live {live_peak}", s.name);
    }
    let svg = plot::render_svg(&[panel.clone(), panel]).unwrap();
    let (root, texts) = element_names_and_text(&svg);
    assert_eq!(root, "svg");
    for t in ["host", "sim_device", "live (trace)"] {
        assert!(texts.iter().any(|x| x.contains(t)), "{t} is named");
    }
}
