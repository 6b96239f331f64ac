//! Sleep and wake: a tag's device memory gives its physical pages back
//! and gets new ones at the same addresses, its contents offloaded to
//! pinned host memory (or discarded) in between.
//!
//! # Implementation details
//!
//! - **One at a time.** Sleep and wake hold the manager's sleep book
//!   (a lock of their own, never a pool lock) from start to end; the
//!   book keeps what each sleeping tag left behind ([`Away`]).
//! - **Sleep** takes the named tags' awake pools, on every device where
//!   a tag has one (a tag with none awake refuses: sleeping twice):
//!   1. every pool goes Awake → Sleeping and waits for the allocations
//!      under way in it (`device/tags.rs`);
//!   2. the devices are synchronised (work queued on any stream may still
//!      use the memory; a capture under way refuses);
//!   3. for the offloaded tags, one block of pinned memory per pool is
//!      taken for all its live blocks (too little pinned memory refuses
//!      here, before anything is released);
//!   4. the live blocks are copied to it in batches of 256 MiB on two
//!      streams per device (`pipeline.rs`), an event after each batch;
//!   5. pages go back while the copies run: free space and the discarded
//!      tags' pages at once, each batch's blocks as soon as its event is
//!      reached ([`Pool::unmap_ranges`](crate::pool::Pool::unmap_ranges)),
//!      then what is left ([`Pool::unmap_all`](crate::pool::Pool::unmap_all));
//!      the pools go Asleep.
//!
//!   A failure in steps 1-4 puts every pool back Awake and gives the
//!   pinned memory back: nothing was released. A failure in step 5 leaves
//!   the pool Asleep with its contents offloaded: wake restores it.
//! - **Wake** takes the named tags' asleep pools (none: waking an awake
//!   tag): each goes Asleep → Waking; pages are mapped under the blocks
//!   still live ([`Pool::map_ranges`](crate::pool::Pool::map_ranges);
//!   blocks freed while asleep stay unmapped, and are not copied back), a
//!   batch at a time while the batch before copies back; the pinned memory
//!   goes back to the pinned pool; the pools go Awake. Running out of
//!   memory, or any failure, unmaps what this wake mapped and leaves every
//!   pool Asleep with its contents kept: nothing is lost, and wake can be
//!   called again.
//! - **Shutdown** while tags sleep gives their offloaded contents back to
//!   the pinned pool first (the program is ending; its blocks are
//!   reported live as usual).

use std::time::Instant;

mod pipeline;

use pipeline::{batches, Direction, LaneSet, Mark};

use super::MemoryManager;
use crate::device::{DeviceAllocator, TagScope, TagUsage};
use crate::device::{TagPoolRef, TagState};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::upstream::BLOCK_ALIGN;

/// One block's contents, offloaded.
#[derive(Debug, Clone, Copy)]
struct Saved {
    addr: usize,
    /// Bytes copied (the bytes asked for, rounded up to 256).
    len: usize,
    /// Its place in the pinned block.
    offset: usize,
}

/// What a sleeping tag left behind on one device.
#[derive(Debug)]
pub(crate) struct Away {
    device: usize,
    tag: String,
    /// The pinned block holding the contents (`None`: discarded or none).
    pinned: Option<usize>,
    saved: Vec<Saved>,
}

/// The sleep book: what each sleeping tag left behind.
#[derive(Debug, Default)]
pub(crate) struct SleepBook {
    away: Vec<Away>,
}

/// What [`MemoryManager::sleep`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SleepReport {
    /// The tags put to sleep (each on every device where it has memory).
    pub tags: Vec<String>,
    /// Bytes of live blocks copied to pinned host memory.
    pub offloaded: usize,
    /// Bytes of live blocks whose contents were discarded.
    pub discarded: usize,
    /// Bytes of physical device memory given back.
    pub released: usize,
    /// Seconds from the first copy queued to the last page given back
    /// (the pages of each batch go as soon as its copies are done).
    pub copy_seconds: f64,
    /// Seconds the whole call took.
    pub seconds: f64,
}

/// What [`MemoryManager::wake`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WakeReport {
    /// The tags woken.
    pub tags: Vec<String>,
    /// Bytes of contents copied back.
    pub restored: usize,
    /// Bytes of physical device memory mapped under live blocks.
    pub mapped: usize,
    /// Seconds from the first page mapped to the last copy done (each
    /// batch's pages are mapped while the batch before copies).
    pub copy_seconds: f64,
    /// Seconds the whole call took.
    pub seconds: f64,
}

/// One batch of a sleep's copies: the part it copies, its blocks' ranges,
/// and the mark its copies reach.
struct Queued {
    part: usize,
    ranges: Vec<(usize, usize)>,
    mark: Mark,
}

/// One pool taking part in a sleep or a wake.
struct Part<'a> {
    device: &'a DeviceAllocator,
    tag: TagPoolRef,
    offload: bool,
}

impl MemoryManager {
    /// Sets `name` as this thread's memory tag until the returned scope is
    /// dropped: the thread's device allocations (outside graph captures)
    /// then come from the tag's own address space, which can
    /// [`sleep`](Self::sleep) and [`wake`](Self::wake) as one. Scopes nest;
    /// the previous tag comes back when a scope ends.
    ///
    /// # Errors
    /// [`Error::Config`] for a name that is empty, longer than
    /// [`MAX_TAG_LEN`](crate::device::MAX_TAG_LEN) bytes or holds a NUL.
    ///
    /// # Examples
    /// ```
    /// let mm = cumem::MemoryManager::new(cumem::Config::new().backend(cumem::BackendChoice::Host))?;
    /// let weights = {
    ///     let _tag = mm.tag("weights")?;
    ///     mm.allocate_device(1 << 20)?
    /// };
    /// mm.sleep(&["weights"], &[])?; // contents to pinned memory, pages released
    /// mm.wake(&["weights"])?; // new pages, same address, contents back
    /// mm.free_device(weights)?;
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub fn tag(&self, name: &str) -> Result<TagScope> {
        TagScope::enter(name)
    }

    /// Puts tags to sleep: the live blocks of each tag in `offload` are
    /// copied to pinned host memory, those of each tag in `discard` are
    /// not; then every physical page of these tags (live and free) is given
    /// back to the driver. Their addresses stay reserved: pointers held by
    /// the program stay valid names for memory that is away, and
    /// [`wake`](Self::wake) puts memory back at the same addresses.
    ///
    /// The program must not use the tags' memory (on the host or in work
    /// it queues) from the call until `wake` returns; work queued before
    /// the call is waited for. While a tag sleeps, allocating in it fails
    /// with [`Error::Tag`]; freeing its blocks is fine (a freed block is
    /// not copied back).
    ///
    /// # Errors
    /// Nothing is released when the call fails before its copies start:
    /// - [`Error::Config`]: a bad or repeated name, or a tag in both lists;
    /// - [`Error::Tag`]: a tag that never allocated, or none of whose
    ///   pools is awake (sleeping twice), or too little pinned memory to
    ///   hold the offloaded contents (the message says how much);
    /// - [`Error::Capture`]: a graph capture under way;
    /// - [`Error::ShutDown`], driver errors.
    ///
    /// A device fault while the contents are copied or the pages given
    /// back leaves the tags asleep with what was copied (wake restores it).
    pub fn sleep(&self, offload: &[&str], discard: &[&str]) -> Result<SleepReport> {
        let start = Instant::now();
        self.check_running("sleep")?;
        check_names(offload.iter().chain(discard))?;
        let mut book = lock(&self.sleep_book);
        let parts = self.parts(offload, discard, TagState::Awake)?;
        // 1. No allocation in the pools from here on.
        for (i, p) in parts.iter().enumerate() {
            if let Err(e) = p.tag.begin_sleep() {
                parts[..i].iter().for_each(|p| p.tag.end_sleep(false));
                return Err(e);
            }
        }
        let undo = |e: Error, pinned: &[Option<usize>]| {
            for &addr in pinned.iter().flatten() {
                let _ = self.free_pinned(addr as *mut u8);
            }
            parts.iter().for_each(|p| p.tag.end_sleep(false));
            e
        };
        // 2. No queued work uses the memory.
        if let Err(e) = each_device(&parts, |d| d.synchronize_for_tags()) {
            return Err(undo(e, &[]));
        }
        // 3. Pinned memory for every offloaded pool, before anything goes.
        let mut report = SleepReport::default();
        let mut plans = Vec::with_capacity(parts.len());
        let mut pinned = Vec::with_capacity(parts.len());
        for p in &parts {
            let (saved, total) = plan_copies(&p.tag.pool.live_blocks());
            if !p.offload || total == 0 {
                report.discarded += if p.offload { 0 } else { total };
                plans.push(Vec::new());
                pinned.push(None);
                continue;
            }
            match self.allocate_pinned_block(total, BLOCK_ALIGN) {
                Ok(a) => pinned.push(Some(a.addr)),
                Err(e) => {
                    let e = Error::Tag {
                        tag: p.tag.name.to_string(),
                        why: format!(
                            "sleep needs {total} B of pinned host memory to offload it and could not get them \
                             ({e}); nothing was released"
                        ),
                    };
                    return Err(undo(e, &pinned));
                }
            }
            report.offloaded += total;
            plans.push(saved);
        }
        // 4. Copy out, a batch at a time.
        let copy_start = Instant::now();
        let mut lanes = LaneSet::default();
        let mut queued: Vec<Queued> = Vec::new();
        let q = (|| -> Result<()> {
            for (i, ((p, saved), host)) in parts.iter().zip(&plans).zip(&pinned).enumerate() {
                let Some(host) = *host else { continue };
                for batch in batches(saved) {
                    // SAFETY: `host` is the pinned block taken for this
                    // pool, which the plan's offsets fit; the blocks are
                    // live blocks of a pool that sleeps (nothing allocates
                    // there) on a synchronised device; both stay so until
                    // the marks are waited for or the lanes synchronised
                    // (below, on every path).
                    let mark = unsafe { lanes.copy(self, p.device, Direction::Out, host, batch)? };
                    queued.push(Queued { part: i, ranges: batch.iter().map(|s| (s.addr, s.len)).collect(), mark });
                }
            }
            Ok(())
        })();
        if let Err(e) = q {
            let _ = lanes.synchronize();
            return Err(undo(e, &pinned));
        }
        // 5. Release every page: free space and the discarded tags' at
        // once, each batch's blocks as soon as its copies are done, then
        // what is left (pieces shared by blocks of two batches).
        let mut first_error = None;
        let mut note = |r: Result<usize>| match r {
            Ok(bytes) => report.released += bytes,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        };
        for p in &parts {
            note(if p.offload { p.tag.pool.unmap_free() } else { p.tag.pool.unmap_all() });
        }
        for q in &queued {
            // A failed copy leaves its blocks mapped (and gives back no more).
            match q.mark.wait() {
                Ok(()) => note(parts[q.part].tag.pool.unmap_ranges(&q.ranges)),
                Err(e) => {
                    note(Err(e));
                    break;
                }
            }
        }
        if let Err(e) = lanes.synchronize() {
            note(Err(e));
        }
        report.copy_seconds = copy_start.elapsed().as_secs_f64();
        for ((p, saved), pinned) in parts.iter().zip(plans).zip(pinned) {
            note(p.tag.pool.unmap_all());
            p.tag.end_sleep(true);
            book.away.push(Away { device: p.device.ordinal(), tag: p.tag.name.to_string(), pinned, saved });
            if !report.tags.iter().any(|t| **t == *p.tag.name) {
                report.tags.push(p.tag.name.to_string());
            }
        }
        report.seconds = start.elapsed().as_secs_f64();
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Wakes tags put to sleep by [`sleep`](Self::sleep) (an empty list:
    /// every sleeping tag): new physical memory is mapped under their live
    /// blocks at the same addresses, the offloaded contents are copied
    /// back (a discarded tag's blocks hold no defined contents), and
    /// allocation in them works again. CUDA graphs captured before the
    /// sleep that use the memory replay as before.
    ///
    /// # Errors
    /// Nothing changes when the call fails (the tags stay asleep, their
    /// contents kept): [`Error::Config`] for a bad name; [`Error::Tag`]
    /// for a tag that never allocated or is not asleep (waking an awake
    /// tag); [`Error::OutOfMemory`] when the device can't give the memory;
    /// [`Error::Capture`]; [`Error::ShutDown`]; driver errors.
    pub fn wake(&self, tags: &[&str]) -> Result<WakeReport> {
        let start = Instant::now();
        self.check_running("wake")?;
        check_names(tags.iter())?;
        let mut book = lock(&self.sleep_book);
        let named: Vec<String> = if tags.is_empty() {
            let mut all: Vec<String> = book.away.iter().map(|a| a.tag.clone()).collect();
            all.sort();
            all.dedup();
            all
        } else {
            tags.iter().map(|t| t.to_string()).collect()
        };
        let names: Vec<&str> = named.iter().map(String::as_str).collect();
        let parts = self.parts(&names, &[], TagState::Asleep)?;
        for (i, p) in parts.iter().enumerate() {
            if let Err(e) = p.tag.begin_wake() {
                parts[..i].iter().for_each(|p| p.tag.end_wake(false));
                return Err(e);
            }
        }
        let give_up = |e: Error, mapped: &[TagPoolRef]| {
            for a in mapped {
                if let Err(e) = a.pool.unmap_all() {
                    eprintln!("cumem: unmapping tag '{}' again after a failed wake failed: {e}", a.name);
                }
            }
            parts.iter().for_each(|p| p.tag.end_wake(false));
            e
        };
        if let Err(e) = each_device(&parts, |d| d.synchronize_for_tags()) {
            return Err(give_up(e, &[]));
        }
        // What comes back: the blocks still live, at the size they had.
        let mut report = WakeReport { tags: named.clone(), ..WakeReport::default() };
        let mut plans = Vec::with_capacity(parts.len());
        let mut pinned = Vec::with_capacity(parts.len());
        let mut lives = Vec::with_capacity(parts.len());
        for p in &parts {
            let live = p.tag.pool.live_blocks();
            let away = book.away.iter().find(|a| a.device == p.device.ordinal() && a.tag == *p.tag.name);
            let saved: Vec<Saved> = away
                .map(|a| {
                    a.saved
                        .iter()
                        .filter(|s| live.binary_search_by_key(&s.addr, |b| b.0).is_ok_and(|i| live[i].1 >= s.len))
                        .copied()
                        .collect()
                })
                .unwrap_or_default();
            report.restored += saved.iter().map(|s| s.len).sum::<usize>();
            pinned.push(away.and_then(|a| a.pinned));
            plans.push(saved);
            lives.push(live);
        }
        // Pages under them, a batch at a time, mapping one while one copies.
        let copy_start = Instant::now();
        let mut lanes = LaneSet::default();
        let mut mapped = Vec::new();
        let r = (|| -> Result<()> {
            for (((p, saved), host), live) in parts.iter().zip(&plans).zip(&pinned).zip(&lives) {
                mapped.push(p.tag.clone());
                let size_of = |addr: usize| live.binary_search_by_key(&addr, |b| b.0).map_or(0, |i| live[i].1);
                // Blocks with nothing to copy back (a discarded tag's).
                let bare: Vec<(usize, usize)> = live
                    .iter()
                    .filter(|b| saved.binary_search_by_key(&b.0, |s| s.addr).is_err())
                    .map(|&(addr, size, _)| (addr, size))
                    .collect();
                report.mapped += p.tag.pool.map_ranges(&bare)?;
                let Some(host) = *host else { continue };
                for batch in batches(saved) {
                    let ranges: Vec<(usize, usize)> = batch.iter().map(|s| (s.addr, size_of(s.addr))).collect();
                    report.mapped += p.tag.pool.map_ranges(&ranges)?;
                    // SAFETY: the pinned block holds the sleep's copies at
                    // the planned offsets and is freed only after the
                    // lanes are synchronised (below, on every path); the
                    // blocks are live blocks of a pool that wakes (nothing
                    // allocates there), now mapped.
                    unsafe { lanes.copy(self, p.device, Direction::In, host, batch)? };
                }
            }
            lanes.synchronize()
        })();
        if let Err(e) = r {
            let _ = lanes.synchronize();
            return Err(give_up(e, &mapped));
        }
        report.copy_seconds = copy_start.elapsed().as_secs_f64();
        for p in &parts {
            let ordinal = p.device.ordinal();
            if let Some(i) = book.away.iter().position(|a| a.device == ordinal && a.tag == *p.tag.name) {
                if let Some(addr) = book.away.swap_remove(i).pinned {
                    let _ = self.free_pinned(addr as *mut u8);
                }
            }
            p.tag.end_wake(true);
        }
        report.seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Every memory tag on every initialised device: its state, its
    /// pool's figures, and the bytes it has offloaded while asleep.
    pub fn tag_usage(&self) -> Vec<TagUsage> {
        let book = lock(&self.sleep_book);
        let mut out = Vec::new();
        for d in self.initialised_devices() {
            for a in d.tag_pools() {
                let mut u = a.usage(d.ordinal());
                u.offloaded = book
                    .away
                    .iter()
                    .filter(|w| w.device == d.ordinal() && w.tag == u.name)
                    .flat_map(|w| w.saved.iter().map(|s| s.len))
                    .sum();
                out.push(u);
            }
        }
        out
    }

    /// Gives sleeping tags' offloaded contents back to the pinned pool.
    pub(crate) fn drop_offloaded(&self) {
        let mut book = lock(&self.sleep_book);
        for a in book.away.drain(..) {
            if let Some(addr) = a.pinned {
                let _ = self.free_pinned(addr as *mut u8);
            }
        }
    }

    /// The pools of `offload` and `discard` on every initialised device
    /// that are in state `from` (sleep takes the awake ones, wake the
    /// asleep ones: a tag that first allocated on a device while it slept
    /// elsewhere has an awake pool there, which the next sleep takes).
    ///
    /// # Errors
    /// [`Error::Tag`] for a tag with no pool anywhere, or none in `from`
    /// (sleeping twice, waking a tag that is awake).
    fn parts(&self, offload: &[&str], discard: &[&str], from: TagState) -> Result<Vec<Part<'_>>> {
        let mut parts = Vec::new();
        for (names, off) in [(offload, true), (discard, false)] {
            for &name in names {
                let mut states = Vec::new();
                for d in self.initialised_devices() {
                    if let Some(pool) = d.tag_pool(name) {
                        let state = pool.state();
                        if state == from {
                            parts.push(Part { device: d, tag: pool, offload: off });
                        } else {
                            states.push(state);
                        }
                    }
                }
                if parts.iter().any(|p| *p.tag.name == *name) {
                    continue;
                }
                let why = match states.first() {
                    None => "no device memory was ever allocated under this tag".to_string(),
                    Some(now) => format!("its memory is {now}, not {from} (sleeping twice, or waking an awake tag)"),
                };
                return Err(Error::Tag { tag: name.to_string(), why });
            }
        }
        Ok(parts)
    }
}

/// Where each live block's contents go in one pinned block, and its size.
fn plan_copies(live: &[(usize, usize, usize)]) -> (Vec<Saved>, usize) {
    let mut offset = 0;
    let saved = live
        .iter()
        .map(|&(addr, size, requested)| {
            let len = requested.next_multiple_of(BLOCK_ALIGN).min(size);
            let s = Saved { addr, len, offset };
            offset += len;
            s
        })
        .collect();
    (saved, offset)
}

/// Runs `f` once for every device among `parts`.
fn each_device(parts: &[Part<'_>], mut f: impl FnMut(&DeviceAllocator) -> Result<()>) -> Result<()> {
    let mut done: Vec<usize> = Vec::new();
    for p in parts {
        if !done.contains(&p.device.ordinal()) {
            f(p.device)?;
            done.push(p.device.ordinal());
        }
    }
    Ok(())
}

/// Checks every name, and that none appears twice.
fn check_names<'a>(names: impl Iterator<Item = &'a &'a str>) -> Result<()> {
    let mut seen: Vec<&str> = Vec::new();
    for &n in names {
        crate::device::check_tag_name(n)?;
        if seen.contains(&n) {
            return Err(Error::Config(format!("memory tag '{n}' is named twice")));
        }
        seen.push(n);
    }
    Ok(())
}
