//! Memory tags, sleep and wake through the C ABI on the host fallback
//! (whose committed address space models the device's memory): a tag set
//! on the thread, blocks allocated with the C calls, sleep (the tag's
//! mapped bytes drop to 0, its contents go to pinned memory), wake (the
//! same addresses hold the same bytes), the figures PyTorch reads, and
//! every bad input.
//!
//! Every test runs in this process's one manager, with tags of its own,
//! one test at a time (`serial`): the device's figures are compared
//! exactly, and a wake of "every sleeping tag" reaches only the test's
//! own.

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::{null, null_mut};
use std::sync::{Mutex, MutexGuard, PoisonError};

use cumem_c::*;

const MIB: usize = 1 << 20;

/// Held by each test for its whole run.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn last_error() -> String {
    // SAFETY: cumem_last_error returns a NUL-terminated string valid until
    // this thread's next failing call.
    unsafe { CStr::from_ptr(cumem_last_error()) }.to_string_lossy().into_owned()
}

/// Sets the thread's tag (`None` clears it).
fn set_tag(name: Option<&str>) -> CumemStatus {
    let c = name.map(|n| CString::new(n).unwrap());
    // SAFETY: NULL or a NUL-terminated string that outlives the call.
    unsafe { cumem_tag_set(c.as_ref().map_or(null(), |c| c.as_ptr())) }
}

/// The thread's tag as `cumem_tag_get` writes it.
fn tag() -> String {
    let mut buf = [0 as c_char; CUMEM_TAG_NAME_CAP];
    // SAFETY: `buf` holds CUMEM_TAG_NAME_CAP bytes; `needed` may be NULL.
    assert_eq!(unsafe { cumem_tag_get(buf.as_mut_ptr(), buf.len(), null_mut()) }, CumemStatus::Ok);
    // SAFETY: cumem_tag_get NUL-terminates what it writes.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

fn allocate(size: usize) -> Result<*mut c_void, CumemStatus> {
    let mut p = null_mut();
    // SAFETY: `p` is valid for a write.
    match unsafe { cumem_allocate_device(size, &mut p) } {
        CumemStatus::Ok => Ok(p),
        s => Err(s),
    }
}

fn pattern(size: usize, seed: u8) -> Vec<u8> {
    (0..size).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
}

/// Fills device block `p` with `pattern(size, seed)` (the host queue
/// copies at once).
fn fill(p: *mut c_void, size: usize, seed: u8) {
    let data = pattern(size, seed);
    // SAFETY: `p` is a live device block of at least `size` bytes; the
    // host fallback's queue (any stream value) copies before returning.
    let s = unsafe { cumem_copy_to_device_async(p, data.as_ptr().cast(), size, null_mut()) };
    assert_eq!(s, CumemStatus::Ok, "{}", last_error());
}

fn holds(p: *mut c_void, size: usize, seed: u8) -> bool {
    let mut back = vec![0u8; size];
    // SAFETY: as in `fill`, reading into `back`.
    let s = unsafe { cumem_copy_to_host_async(back.as_mut_ptr().cast(), p, size, null_mut()) };
    assert_eq!(s, CumemStatus::Ok, "{}", last_error());
    back == pattern(size, seed)
}

/// Every tag entry (the array grows until it holds them all).
fn usage() -> Vec<CumemTagUsage> {
    let mut count = 0usize;
    // SAFETY: NULL with capacity 0 asks for the count; `count` is valid.
    let s = unsafe { cumem_tag_usage(null_mut(), 0, &mut count) };
    assert!(s == CumemStatus::Ok || s == CumemStatus::BufferTooSmall, "{s:?}");
    loop {
        let cap = count + 4;
        let mut v: Vec<CumemTagUsage> = Vec::with_capacity(cap);
        // SAFETY: `v` has room for `cap` entries; `count` is valid.
        let s = unsafe { cumem_tag_usage(v.as_mut_ptr(), cap, &mut count) };
        if s == CumemStatus::BufferTooSmall {
            continue; // a tag was made meanwhile
        }
        assert_eq!(s, CumemStatus::Ok, "{}", last_error());
        // SAFETY: the call wrote `count` (at most `cap`) entries.
        unsafe { v.set_len(count) };
        return v;
    }
}

fn name_of(u: &CumemTagUsage) -> String {
    // SAFETY: the name is NUL-terminated within its array.
    unsafe { CStr::from_ptr(u.name.as_ptr()) }.to_string_lossy().into_owned()
}

fn usage_of(tag: &str) -> CumemTagUsage {
    usage().into_iter().find(|u| name_of(u) == tag).unwrap_or_else(|| panic!("tag {tag} has no entry"))
}

fn device_stats() -> CumemDeviceStats {
    let mut s = CumemDeviceStats::default();
    // SAFETY: `s` is valid for a write.
    assert_eq!(unsafe { cumem_device_stats(0, &mut s) }, CumemStatus::Ok);
    s
}

fn figures() -> CumemTorchFigures {
    let mut f = CumemTorchFigures::default();
    // SAFETY: `f` is valid for a write.
    assert_eq!(unsafe { cumem_torch_figures(0, &mut f) }, CumemStatus::Ok);
    f
}

/// `cumem_sleep` with lists of names.
fn sleep(offload: &[&str], discard: &[&str], out: Option<&mut CumemSleepReport>) -> CumemStatus {
    let o: Vec<CString> = offload.iter().map(|n| CString::new(*n).unwrap()).collect();
    let d: Vec<CString> = discard.iter().map(|n| CString::new(*n).unwrap()).collect();
    let op: Vec<*const c_char> = o.iter().map(|c| c.as_ptr()).collect();
    let dp: Vec<*const c_char> = d.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: both arrays hold their lengths of NUL-terminated strings
    // that outlive the call; `out` is NULL or valid.
    unsafe { cumem_sleep(op.as_ptr(), op.len(), dp.as_ptr(), dp.len(), out.map_or(null_mut(), |r| r)) }
}

fn wake(tags: &[&str], out: Option<&mut CumemWakeReport>) -> CumemStatus {
    let t: Vec<CString> = tags.iter().map(|n| CString::new(*n).unwrap()).collect();
    let tp: Vec<*const c_char> = t.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: as in `sleep`.
    unsafe { cumem_wake(tp.as_ptr(), tp.len(), out.map_or(null_mut(), |r| r)) }
}

#[test]
fn the_thread_tag_is_set_read_and_cleared() {
    let _serial = serial();
    assert_eq!(set_tag(None), CumemStatus::Ok);
    assert_eq!(tag(), "", "no tag: the empty name");
    let mut set = -1;
    // SAFETY: `set` is valid for a write.
    assert_eq!(unsafe { cumem_tag_is_set(&mut set) }, CumemStatus::Ok);
    assert_eq!(set, 0);
    assert_eq!(set_tag(Some("t_weights")), CumemStatus::Ok);
    assert_eq!(tag(), "t_weights");
    // SAFETY: as above.
    assert_eq!(unsafe { cumem_tag_is_set(&mut set) }, CumemStatus::Ok);
    assert_eq!(set, 1);
    // SAFETY: NULL `out` is refused before any write.
    assert_eq!(unsafe { cumem_tag_is_set(null_mut()) }, CumemStatus::InvalidArgument);

    // Text out: the size asked for, a buffer too small, NULL with a length.
    let mut needed = 0usize;
    // SAFETY: NULL buffer with length 0; `needed` is valid.
    assert_eq!(unsafe { cumem_tag_get(null_mut(), 0, &mut needed) }, CumemStatus::BufferTooSmall);
    assert_eq!(needed, "t_weights".len() + 1);
    let mut small = [0 as c_char; 4];
    // SAFETY: `small` holds 4 bytes.
    assert_eq!(unsafe { cumem_tag_get(small.as_mut_ptr(), 4, null_mut()) }, CumemStatus::BufferTooSmall);
    // SAFETY: NUL-terminated by the call.
    assert_eq!(unsafe { CStr::from_ptr(small.as_ptr()) }.to_str().unwrap(), "t_w");
    // SAFETY: NULL buffer with a length is refused before any write.
    assert_eq!(unsafe { cumem_tag_get(null_mut(), 8, null_mut()) }, CumemStatus::InvalidArgument);

    // Bad names are refused, and the tag set before stays.
    assert_eq!(set_tag(Some("")), CumemStatus::Config);
    assert!(last_error().contains("1 to 128 bytes"), "{}", last_error());
    assert_eq!(set_tag(Some(&"x".repeat(CUMEM_MAX_TAG_LEN + 1))), CumemStatus::Config);
    assert_eq!(set_tag(Some(&"x".repeat(CUMEM_MAX_TAG_LEN))), CumemStatus::Ok);
    assert_eq!(tag().len(), CUMEM_MAX_TAG_LEN, "the longest name fits the usage entry's array");
    assert_eq!(set_tag(Some("t_weights")), CumemStatus::Ok);
    let not_utf8 = [0xffu8, 0xfe, 0];
    // SAFETY: a NUL-terminated byte string.
    assert_eq!(unsafe { cumem_tag_set(not_utf8.as_ptr().cast()) }, CumemStatus::Config);
    assert!(last_error().contains("UTF-8"), "{}", last_error());
    assert_eq!(tag(), "t_weights");

    // The tag is the thread's own.
    std::thread::spawn(|| assert_eq!(tag(), "", "a new thread has no tag")).join().unwrap();
    assert_eq!(set_tag(None), CumemStatus::Ok);
    assert_eq!(tag(), "");
}

#[test]
fn tagged_blocks_count_in_the_tag_and_in_what_pytorch_reads() {
    let _serial = serial();
    assert_eq!(set_tag(Some("t_figures")), CumemStatus::Ok);
    let p = allocate(3 * MIB).unwrap();
    assert_eq!(set_tag(None), CumemStatus::Ok);
    let u = usage_of("t_figures");
    assert_eq!(u.state, CumemTagState::Awake);
    assert_eq!(u.device, 0);
    assert_eq!((u.in_use, u.requested, u.live_blocks), (3 * MIB, 3 * MIB, 1));
    assert!(u.mapped >= 3 * MIB && u.reserved >= u.mapped, "{u:?}");
    assert_eq!(u.offloaded, 0);
    // The device's figures hold every tag (the other tests' tags hold no
    // live block when they end); the tags' mapped bytes are part of what
    // PyTorch reads as reserved.
    let d = device_stats();
    assert_eq!(d.tagged_in_use, 3 * MIB);
    assert!(d.tagged_mapped >= u.mapped && d.tagged_peak_mapped >= d.tagged_mapped, "{d:?}");
    let f = figures();
    assert_eq!((f.tagged_in_use, f.tagged_requested), (3 * MIB as u64, 3 * MIB as u64));
    assert_eq!(f.tagged_mapped, d.tagged_mapped as u64);
    assert!(f.reserved >= f.tagged_mapped + d.pool.reserved as u64 && f.peak_reserved >= f.reserved, "{f:?}");
    assert_eq!(cumem_free_device(p), CumemStatus::Ok);
    assert_eq!(usage_of("t_figures").live_blocks, 0, "a tagged block is freed with no tag set");
    assert_eq!(cumem_free_device(p), CumemStatus::DoubleFree);
}

#[test]
fn private_pool_blocks_are_never_tagged() {
    let _serial = serial();
    assert_eq!(set_tag(Some("t_private")), CumemStatus::Ok);
    let (mut pool, mut p) = (null_mut(), null_mut());
    // SAFETY: `pool` and `p` are valid for writes; the handle is live.
    unsafe {
        assert_eq!(cumem_graph_pool_create(0, &mut pool), CumemStatus::Ok);
        assert_eq!(cumem_graph_pool_allocate(pool, MIB, &mut p), CumemStatus::Ok);
    }
    assert_eq!(tag(), "t_private", "the thread's tag is as it was");
    let q = allocate(MIB).unwrap();
    assert_eq!(set_tag(None), CumemStatus::Ok);
    assert_eq!(usage_of("t_private").live_blocks, 1, "only the ordinary allocation is the tag's");
    // SAFETY: the handle is live, then not used again.
    unsafe {
        assert_eq!(cumem_graph_pool_free(pool, p), CumemStatus::Ok);
        assert_eq!(cumem_graph_pool_destroy(pool), CumemStatus::Ok);
    }
    assert_eq!(cumem_free_device(q), CumemStatus::Ok);
}

#[test]
fn usage_into_an_array_too_small() {
    let _serial = serial();
    assert_eq!(set_tag(Some("t_usage_a")), CumemStatus::Ok);
    let a = allocate(4096).unwrap();
    assert_eq!(set_tag(Some("t_usage_b")), CumemStatus::Ok);
    let b = allocate(4096).unwrap();
    assert_eq!(set_tag(None), CumemStatus::Ok);
    let mut count = 0usize;
    let mut one = [usage_of("t_usage_a")];
    one[0].in_use = usize::MAX;
    // SAFETY: `one` holds 1 entry; `count` is valid.
    let s = unsafe { cumem_tag_usage(one.as_mut_ptr(), 1, &mut count) };
    assert_eq!(s, CumemStatus::BufferTooSmall);
    assert!(count >= 2, "{count}");
    assert_ne!(one[0].in_use, usize::MAX, "the first entry was written");
    // SAFETY: NULL `count`, NULL `out` with a capacity: refused first.
    unsafe {
        assert_eq!(cumem_tag_usage(one.as_mut_ptr(), 1, null_mut()), CumemStatus::InvalidArgument);
        assert_eq!(cumem_tag_usage(null_mut(), 3, &mut count), CumemStatus::InvalidArgument);
    }
    assert_eq!(cumem_free_device(a), CumemStatus::Ok);
    assert_eq!(cumem_free_device(b), CumemStatus::Ok);
}

#[test]
fn sleep_and_wake_keep_contents_at_the_same_addresses() {
    let _serial = serial();
    let sizes = [1000, 4 * MIB + 17, 256, 2 * MIB];
    assert_eq!(set_tag(Some("c_weights")), CumemStatus::Ok);
    let weights: Vec<*mut c_void> = sizes.iter().map(|&s| allocate(s).unwrap()).collect();
    assert_eq!(set_tag(Some("c_kv")), CumemStatus::Ok);
    let kv = allocate(8 * MIB).unwrap();
    assert_eq!(set_tag(None), CumemStatus::Ok);
    let plain = allocate(MIB).unwrap();
    for (i, (&p, &s)) in weights.iter().zip(&sizes).enumerate() {
        fill(p, s, i as u8);
    }
    fill(plain, MIB, 77);
    let w_before = usage_of("c_weights");
    let kv_before = usage_of("c_kv");
    let reserved_before = figures().reserved;

    let mut r = CumemSleepReport::default();
    assert_eq!(sleep(&["c_weights"], &["c_kv"], Some(&mut r)), CumemStatus::Ok, "{}", last_error());
    assert_eq!(r.tags, 2);
    assert!(r.offloaded >= sizes.iter().sum::<usize>(), "{r:?}");
    assert_eq!(r.discarded, 8 * MIB);
    assert_eq!(r.released, w_before.mapped + kv_before.mapped);
    assert!(r.seconds >= r.copy_seconds && r.copy_seconds >= 0.0);
    let w = usage_of("c_weights");
    assert_eq!((w.state, w.mapped, w.reserved), (CumemTagState::Asleep, 0, w_before.reserved));
    assert_eq!(w.offloaded, r.offloaded);
    assert_eq!(w.live_blocks, sizes.len(), "the blocks stay live while away");
    let kv_asleep = usage_of("c_kv");
    assert_eq!((kv_asleep.state, kv_asleep.mapped, kv_asleep.offloaded), (CumemTagState::Asleep, 0, 0));
    // What PyTorch reads as reserved drops by what the tags held.
    assert_eq!(figures().reserved, reserved_before - r.released as u64);
    assert!(holds(plain, MIB, 77), "untagged memory is untouched");

    // Refusals while asleep: each changes nothing.
    assert_eq!(set_tag(Some("c_weights")), CumemStatus::Ok);
    assert_eq!(allocate(4096), Err(CumemStatus::Tag), "allocating in a sleeping tag");
    assert!(last_error().contains("c_weights"), "{}", last_error());
    assert_eq!(set_tag(None), CumemStatus::Ok);
    assert_eq!(sleep(&["c_weights"], &[], None), CumemStatus::Tag, "sleeping twice");
    assert_eq!(sleep(&["c_never_used"], &[], None), CumemStatus::Tag, "a tag with no memory");
    assert_eq!(sleep(&["c_weights"], &["c_weights"], None), CumemStatus::Config, "a tag in both lists");
    assert_eq!(sleep(&[""], &[], None), CumemStatus::Config, "an empty name");
    assert_eq!(wake(&["c_nope"], None), CumemStatus::Tag, "waking a tag with no memory");
    assert_eq!(wake(&["c_kv", "c_kv"], None), CumemStatus::Config, "a name twice");
    let not_utf8 = [0xffu8, 0];
    let bad = [not_utf8.as_ptr().cast::<c_char>()];
    let with_null: [*const c_char; 2] = [c"c_weights".as_ptr(), null()];
    // SAFETY: the lists hold their lengths of pointers, each NULL (refused)
    // or a NUL-terminated string; a NULL list is refused before any read.
    unsafe {
        assert_eq!(cumem_sleep(null(), 1, null(), 0, null_mut()), CumemStatus::InvalidArgument);
        assert_eq!(cumem_sleep(null(), 0, with_null.as_ptr(), 2, null_mut()), CumemStatus::InvalidArgument);
        assert!(last_error().contains("discard[1]"), "{}", last_error());
        assert_eq!(cumem_sleep(bad.as_ptr(), 1, null(), 0, null_mut()), CumemStatus::Config);
        assert_eq!(cumem_wake(null(), 2, null_mut()), CumemStatus::InvalidArgument);
        assert_eq!(cumem_wake(with_null.as_ptr(), 2, null_mut()), CumemStatus::InvalidArgument);
    }
    assert_eq!(usage_of("c_weights").state, CumemTagState::Asleep, "refusals changed nothing");
    assert_eq!(usage_of("c_weights").offloaded, r.offloaded);

    // A block freed while its tag sleeps is not copied back.
    assert_eq!(cumem_free_device(weights[2]), CumemStatus::Ok);

    // Partial wake: the weights only; the KV cache stays asleep.
    let mut wr = CumemWakeReport::default();
    assert_eq!(wake(&["c_weights"], Some(&mut wr)), CumemStatus::Ok, "{}", last_error());
    assert_eq!(wr.tags, 1);
    assert_eq!(wr.restored, r.offloaded - 256, "all but the block freed while asleep");
    assert!(wr.mapped >= sizes.iter().sum::<usize>() - 256, "{wr:?}");
    let w = usage_of("c_weights");
    assert_eq!((w.state, w.offloaded), (CumemTagState::Awake, 0));
    assert!(w.mapped > 0);
    assert_eq!(usage_of("c_kv").state, CumemTagState::Asleep);
    for (i, (&p, &s)) in weights.iter().zip(&sizes).enumerate() {
        if i != 2 {
            assert!(holds(p, s, i as u8), "weights block {i} came back whole at {p:?}");
        }
    }
    assert_eq!(wake(&["c_weights"], None), CumemStatus::Tag, "waking a tag that is awake");

    // No names: every sleeping tag.
    let mut wr = CumemWakeReport::default();
    // SAFETY: a NULL list with no names; `wr` is valid.
    assert_eq!(unsafe { cumem_wake(null(), 0, &mut wr) }, CumemStatus::Ok, "{}", last_error());
    assert_eq!((wr.tags, wr.restored), (1, 0), "the discarded tag wakes with pages, no contents");
    assert!(wr.mapped >= 8 * MIB);
    assert_eq!(usage_of("c_kv").state, CumemTagState::Awake);
    fill(kv, 8 * MIB, 5);
    assert!(holds(kv, 8 * MIB, 5), "the discarded tag's block is usable again");

    // Allocation in the woken tag works again; then everything goes.
    assert_eq!(set_tag(Some("c_weights")), CumemStatus::Ok);
    let again = allocate(4096).unwrap();
    assert_eq!(set_tag(None), CumemStatus::Ok);
    for p in weights.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, p)| *p).chain([kv, plain, again]) {
        assert_eq!(cumem_free_device(p), CumemStatus::Ok, "{}", last_error());
    }
    let mut pinned = CumemPoolStats::default();
    // SAFETY: `pinned` is valid for a write.
    assert_eq!(unsafe { cumem_pinned_stats(&mut pinned) }, CumemStatus::Ok);
    assert_eq!(pinned.in_use, 0, "the offloaded copy went back to the pinned pool");
}
