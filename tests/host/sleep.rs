//! Memory tags, sleep and wake on the host fallback, whose reserved and
//! committed address space models the device's memory: sleep decommits
//! every page of a tag (the tag's mapped bytes drop to 0), wake commits
//! pages again at the same addresses. Every bad input of the API is here.

use cumem::fault::{self, Point, Scope, Trigger};
use cumem::{BackendChoice, Config, Error, MemoryManager, Stream, TagState, TagUsage};

const MIB: usize = 1 << 20;

fn manager() -> MemoryManager {
    MemoryManager::new(Config::new().backend(BackendChoice::Host)).unwrap()
}

/// Fills `size` bytes at device address `ptr` with a pattern drawn from
/// `seed`.
fn fill(mm: &MemoryManager, ptr: u64, size: usize, seed: u8) {
    let data: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    // SAFETY: `ptr` is a live device block of at least `size` bytes; the
    // host queue copies at once, while `data` lives.
    unsafe { mm.copy_to_device_async(ptr, data.as_ptr(), size, &Stream::host()).unwrap() };
}

/// Whether the `size` bytes at `ptr` hold `fill`'s pattern for `seed`.
fn holds(mm: &MemoryManager, ptr: u64, size: usize, seed: u8) -> bool {
    let mut back = vec![0u8; size];
    // SAFETY: as in `fill`, reading into `back`.
    unsafe { mm.copy_to_host_async(back.as_mut_ptr(), ptr, size, &Stream::host()).unwrap() };
    back.iter().enumerate().all(|(i, &b)| b == (i as u8).wrapping_mul(31).wrapping_add(seed))
}

fn tag_error<T>(r: Result<T, Error>) -> bool {
    matches!(r, Err(Error::Tag { .. }))
}

fn usage(mm: &MemoryManager, tag: &str) -> TagUsage {
    mm.tag_usage().into_iter().find(|u| u.name == tag).expect("the tag has a pool")
}

/// Allocates blocks of `sizes` under `tag`, each filled with its own
/// pattern.
fn tagged_blocks(mm: &MemoryManager, tag: &str, sizes: &[usize]) -> Vec<(u64, usize)> {
    let _tag = mm.tag(tag).unwrap();
    sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let p = mm.allocate_device(size).unwrap();
            fill(mm, p, size, i as u8);
            (p, size)
        })
        .collect()
}

const SIZES: [usize; 6] = [1000, 4 * MIB + 17, 256, 3 * MIB, 65536, 9 * MIB];

#[test]
fn offloaded_contents_come_back_at_the_same_addresses() {
    let mm = manager();
    let blocks = tagged_blocks(&mm, "weights", &SIZES);
    let untagged = mm.allocate_device(MIB).unwrap();
    fill(&mm, untagged, MIB, 99);
    let before = usage(&mm, "weights");
    assert_eq!(before.state, TagState::Awake);
    assert!(before.pool.mapped >= SIZES.iter().sum::<usize>());
    assert_eq!(before.pool.live_blocks, SIZES.len());
    assert_eq!(mm.device_stats(0).unwrap().pool.live_blocks, 1, "tagged blocks are not the sync pool's");

    let slept = mm.sleep(&["weights"], &[]).unwrap();
    assert_eq!(slept.tags, vec!["weights".to_string()]);
    assert!(slept.offloaded >= SIZES.iter().sum::<usize>());
    assert_eq!(slept.released, before.pool.mapped, "every mapped byte goes");
    let asleep = usage(&mm, "weights");
    assert_eq!(asleep.state, TagState::Asleep);
    let summary = mm.memory_summary();
    assert!(summary.contains("| tag weights") && summary.contains("tag weights: asleep"), "{summary}");
    let snap = mm.memory_snapshot();
    let tag = snap.pools.iter().find(|p| p.name == "device 0 tag weights").expect("the tag's pool is pictured");
    assert_eq!(tag.stats.live_blocks, SIZES.len());
    assert_eq!(asleep.pool.mapped, 0);
    assert_eq!(asleep.pool.reserved, before.pool.reserved, "the address space stays");
    assert_eq!(asleep.offloaded, slept.offloaded);
    assert!(holds(&mm, untagged, MIB, 99), "untagged memory is untouched");

    let woke = mm.wake(&["weights"]).unwrap();
    assert_eq!(woke.restored, slept.offloaded);
    let after = usage(&mm, "weights");
    assert_eq!(after.state, TagState::Awake);
    assert_eq!(after.offloaded, 0);
    for (i, &(p, size)) in blocks.iter().enumerate() {
        assert!(holds(&mm, p, size, i as u8), "block {i} came back whole");
        mm.free_device(p).unwrap();
    }
    assert_eq!(mm.pinned_stats().in_use, 0, "the offloaded copy went back to the pinned pool");
    mm.free_device(untagged).unwrap();
}

#[test]
fn discarded_tags_release_everything_and_wake_with_pages() {
    let mm = manager();
    let weights = tagged_blocks(&mm, "w", &[2 * MIB]);
    let kv = tagged_blocks(&mm, "kv", &[8 * MIB, 8 * MIB]);
    // A freed block's free space is released too.
    mm.free_device(kv[1].0).unwrap();
    let slept = mm.sleep(&["w"], &["kv"]).unwrap();
    assert_eq!(slept.discarded, 8 * MIB);
    assert_eq!(slept.offloaded, 2 * MIB);
    assert_eq!(usage(&mm, "kv").pool.mapped, 0);
    assert_eq!(usage(&mm, "w").pool.mapped, 0);
    assert_eq!(mm.pinned_stats().in_use, 2 * MIB, "only the offloaded tag takes pinned memory");
    // Partial wake: one tag.
    mm.wake(&["kv"]).unwrap();
    assert_eq!(usage(&mm, "kv").state, TagState::Awake);
    assert_eq!(usage(&mm, "w").state, TagState::Asleep);
    assert!(usage(&mm, "kv").pool.mapped >= 8 * MIB);
    fill(&mm, kv[0].0, 8 * MIB, 5);
    // An empty list wakes every sleeping tag.
    let woke = mm.wake(&[]).unwrap();
    assert_eq!(woke.tags, vec!["w".to_string()]);
    assert!(holds(&mm, weights[0].0, 2 * MIB, 0));
    assert!(holds(&mm, kv[0].0, 8 * MIB, 5));
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let mm = manager();
    let blocks = tagged_blocks(&mm, "a", &[MIB]);
    // Names.
    assert!(matches!(mm.tag(""), Err(Error::Config(_))));
    assert!(matches!(mm.tag(&"x".repeat(200)), Err(Error::Config(_))));
    assert!(matches!(mm.sleep(&["a"], &["a"]), Err(Error::Config(_))), "a tag in both lists");
    assert!(matches!(mm.sleep(&["a", "a"], &[]), Err(Error::Config(_))), "a tag named twice");
    assert!(tag_error(mm.sleep(&["never-used"], &[])), "a tag with no memory");
    assert!(tag_error(mm.sleep(&["a", "never-used"], &[])));
    assert_eq!(usage(&mm, "a").state, TagState::Awake, "a refused sleep leaves the tag awake");
    // Waking a tag that is awake.
    assert!(tag_error(mm.wake(&["a"])));
    mm.sleep(&["a"], &[]).unwrap();
    // Sleeping twice.
    let e = mm.sleep(&["a"], &[]).unwrap_err();
    assert!(e.to_string().contains("asleep"), "{e}");
    // Allocating in a sleeping tag.
    {
        let _tag = mm.tag("a").unwrap();
        let e = mm.allocate_device(4096).unwrap_err();
        assert!(matches!(e, Error::Tag { ref tag, .. } if tag == "a"), "{e}");
    }
    assert_eq!(usage(&mm, "a").pool.live_blocks, 1);
    assert_eq!(usage(&mm, "a").pool.mapped, 0, "the refused allocation mapped nothing");
    // Freeing twice while asleep is still a double free.
    let extra = tagged_blocks(&mm, "b", &[4096])[0].0;
    mm.free_device(extra).unwrap();
    assert!(matches!(mm.free_device(extra), Err(Error::DoubleFree { .. })));
    mm.wake(&["a"]).unwrap();
    assert!(holds(&mm, blocks[0].0, MIB, 0));
    // Other threads are untagged; scopes nest and restore.
    let outer = mm.tag("a").unwrap();
    {
        let _inner = mm.tag("b").unwrap();
        assert_eq!(cumem::device::current_tag().as_deref(), Some("b"));
        let elsewhere = std::thread::scope(|s| s.spawn(cumem::device::current_tag).join().unwrap());
        assert_eq!(elsewhere, None);
    }
    assert_eq!(cumem::device::current_tag().as_deref(), Some("a"));
    drop(outer);
    assert_eq!(cumem::device::current_tag(), None);
}

#[test]
fn a_block_freed_while_asleep_is_not_copied_back() {
    // With the hot block on, the block freed while asleep waits hot (with
    // no pages under it) for the next allocation of its size.
    let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host).hot_block(true)).unwrap();
    let blocks = tagged_blocks(&mm, "t", &[4 * MIB, 4 * MIB, 4 * MIB]);
    mm.sleep(&["t"], &[]).unwrap();
    mm.free_device(blocks[1].0).unwrap();
    let woke = mm.wake(&["t"]).unwrap();
    assert_eq!(woke.restored, 8 * MIB, "two blocks come back, not the freed one");
    assert!(holds(&mm, blocks[0].0, 4 * MIB, 0));
    assert!(holds(&mm, blocks[2].0, 4 * MIB, 2));
    assert!(woke.mapped < 12 * MIB, "the freed block's pages stay unmapped ({} B mapped)", woke.mapped);
    // The freed space serves new allocations in the tag, on mapped pages
    // (writing an unmapped page of the host model faults).
    let _tag = mm.tag("t").unwrap();
    let again = mm.allocate_device(4 * MIB).unwrap();
    fill(&mm, again, 4 * MIB, 7);
    assert!(holds(&mm, again, 4 * MIB, 7));
}

#[test]
fn out_of_memory_during_wake_leaves_the_tag_asleep_with_its_contents() {
    let mm = manager();
    let blocks = tagged_blocks(&mm, "oom", &[6 * MIB, MIB]);
    mm.sleep(&["oom"], &[]).unwrap();
    // The first commit of pages fails, as a device out of memory would.
    fault::arm(&[Point::Map], Trigger::Nth(1), Scope::ThisThread);
    let e = mm.wake(&["oom"]);
    fault::disarm();
    assert!(e.is_err(), "the injected failure reaches the caller");
    let u = usage(&mm, "oom");
    assert_eq!(u.state, TagState::Asleep);
    assert_eq!(u.pool.mapped, 0, "nothing this wake mapped stays mapped");
    assert_eq!(u.offloaded, 7 * MIB);
    mm.wake(&["oom"]).unwrap();
    assert!(holds(&mm, blocks[0].0, 6 * MIB, 0));
    assert!(holds(&mm, blocks[1].0, MIB, 1));
}

#[test]
fn too_little_pinned_memory_refuses_before_anything_is_released() {
    let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host).max_pinned_pool_size(2 * MIB)).unwrap();
    let blocks = tagged_blocks(&mm, "big", &[8 * MIB]);
    let mapped = usage(&mm, "big").pool.mapped;
    let e = mm.sleep(&["big"], &[]).unwrap_err();
    assert!(matches!(e, Error::Tag { .. }) && e.to_string().contains("pinned"), "{e}");
    let u = usage(&mm, "big");
    assert_eq!(u.state, TagState::Awake);
    assert_eq!(u.pool.mapped, mapped, "nothing was released");
    assert!(holds(&mm, blocks[0].0, 8 * MIB, 0));
    // Discarding needs no pinned memory.
    mm.sleep(&[], &["big"]).unwrap();
    assert_eq!(usage(&mm, "big").pool.mapped, 0);
}

#[test]
fn shutdown_while_asleep_gives_the_offloaded_copies_back() {
    let mm = manager();
    let blocks = tagged_blocks(&mm, "s", &[3 * MIB]);
    mm.sleep(&["s"], &[]).unwrap();
    let report = mm.shutdown().unwrap();
    assert_eq!(mm.pinned_stats().in_use, 0);
    assert!(report.live.iter().any(|l| l.addr == blocks[0].0 as usize), "the slept block is reported live");
    assert!(matches!(mm.wake(&["s"]), Err(Error::ShutDown(_))));
}

#[test]
fn a_hundred_cycles_hold_no_more_than_the_first() {
    let mm = manager();
    let blocks = tagged_blocks(&mm, "c", &[5 * MIB, 300_000, 2 * MIB]);
    let kv = tagged_blocks(&mm, "kv", &[4 * MIB]);
    mm.sleep(&["c"], &["kv"]).unwrap();
    mm.wake(&[]).unwrap();
    let first = (usage(&mm, "c").pool.reserved, usage(&mm, "kv").pool.reserved, mm.pinned_stats().reserved);
    for cycle in 0..100 {
        mm.sleep(&["c"], &["kv"]).unwrap();
        mm.wake(&[]).unwrap();
        let now = (usage(&mm, "c").pool.reserved, usage(&mm, "kv").pool.reserved, mm.pinned_stats().reserved);
        assert_eq!(now, first, "cycle {cycle}: address space and pinned memory stay as after the first");
    }
    for (i, &(p, size)) in blocks.iter().enumerate() {
        assert!(holds(&mm, p, size, i as u8));
    }
    assert_eq!(kv.len(), 1);
}

#[test]
fn allocations_racing_a_sleep_either_land_before_it_or_are_refused() {
    let mm = manager();
    let _seed = tagged_blocks(&mm, "race", &[MIB]);
    let stop = std::sync::atomic::AtomicBool::new(false);
    // The workers only allocate and free while the tag may sleep (using
    // the memory meanwhile is the program's error); contents are checked
    // after the wake.
    let kept: Vec<u64> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let (mm, stop) = (&mm, &stop);
                s.spawn(move || {
                    let _tag = mm.tag("race").unwrap();
                    let mut kept = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match mm.allocate_device(64 * 1024) {
                            Ok(p) => {
                                kept.push(p);
                                if kept.len() > 8 {
                                    mm.free_device(kept.remove(0)).unwrap();
                                }
                            }
                            Err(Error::Tag { .. }) => std::thread::yield_now(),
                            Err(e) => panic!("{e}"),
                        }
                    }
                    kept
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(20));
        mm.sleep(&["race"], &[]).unwrap();
        assert_eq!(usage(&mm, "race").pool.mapped, 0, "no allocation mapped pages while asleep");
        std::thread::sleep(std::time::Duration::from_millis(20));
        mm.wake(&["race"]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    assert_eq!(usage(&mm, "race").pool.live_blocks, kept.len() + 1);
    for (i, &p) in kept.iter().enumerate() {
        fill(&mm, p, 64 * 1024, i as u8);
    }
    for (i, &p) in kept.iter().enumerate() {
        assert!(holds(&mm, p, 64 * 1024, i as u8), "blocks live at once don't overlap");
    }
}

#[test]
fn a_tag_sleeps_on_every_device_where_it_has_memory() {
    let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host).host_devices(2)).unwrap();
    let on0 = tagged_blocks(&mm, "w", &[2 * MIB])[0].0;
    mm.sleep(&["w"], &[]).unwrap();
    // The tag's first memory on device 1 comes while it sleeps on device 0:
    // a pool of its own, awake, which the next sleep takes.
    let on1 = {
        let _tag = mm.tag("w").unwrap();
        mm.allocate_device_for(1, MIB).unwrap()
    };
    fill(&mm, on1, MIB, 9);
    let states = |mm: &MemoryManager| mm.tag_usage().iter().map(|u| (u.device, u.state)).collect::<Vec<_>>();
    assert_eq!(states(&mm), vec![(0, TagState::Asleep), (1, TagState::Awake)]);
    let slept = mm.sleep(&["w"], &[]).unwrap();
    assert_eq!(slept.offloaded, MIB, "only the awake pool sleeps now");
    assert!(tag_error(mm.sleep(&["w"], &[])), "every pool asleep: sleeping twice");
    let woke = mm.wake(&["w"]).unwrap();
    assert_eq!(woke.restored, 3 * MIB, "both pools wake");
    assert_eq!(states(&mm), vec![(0, TagState::Awake), (1, TagState::Awake)]);
    assert!(holds(&mm, on0, 2 * MIB, 0));
    assert!(holds(&mm, on1, MIB, 9));
    assert!(tag_error(mm.wake(&["w"])), "waking a tag that is awake");
}
