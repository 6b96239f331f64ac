//! Page remapping over an expandable segment: mapping runs of pages,
//! unmapping and lending whole pieces of free space, the memory kept for
//! the next map, and the old mappings of lent memory. The region does the
//! work (`region/pages.rs`, `region/stale.rs`); here chunks become region
//! offsets and back, the device and its peers are waited for, and the
//! driver's out-of-memory error becomes [`Error::OutOfMemory`].

use super::Expandable;
use crate::cuda::{captures_under_way, device_context, vmm};
use crate::error::{Error, PoolKind, Result};
use crate::sync::lock;
use crate::upstream::region::{Planned, Region, Released, StaleUnmap};
use crate::upstream::{Chunk, Queued};

/// Waits for the work queued on each device in `peers` (work on a peer's
/// streams may use a region's memory too).
fn synchronize_peers(peers: &[usize]) -> Result<()> {
    for &peer in peers {
        if let Some(ctx) = device_context(peer)? {
            vmm::synchronize(&ctx)?;
        }
    }
    Ok(())
}

impl Expandable {
    /// Maps `runs`. `device_free` reads the device's free memory, which
    /// sizes new pieces ([`remap_piece`](crate::upstream::remap_piece)),
    /// only where the memory kept does not cover the runs
    /// ([`free_for_pieces`](Self::free_for_pieces)).
    /// The map ends the move under way, if any ([`Region::end_move`]).
    pub(super) fn map_runs(&self, runs: &[Chunk], kind: PoolKind, device_free: &dyn Fn() -> usize) -> Result<u64> {
        let mapped = self.follow_peers().and_then(|()| {
            self.unmap_released();
            let need: usize = runs.iter().map(|r| r.size).sum();
            let new = need.saturating_sub(self.kept());
            let free = if new > 0 { self.free_for_pieces(device_free) } else { usize::MAX };
            let calls = self.map_each(runs, kind, free)?;
            lock(&self.free_seen).made += new;
            Ok(calls)
        });
        lock(&self.region).end_move();
        mapped
    }

    /// The device's free memory for sizing new pieces: the last reading
    /// less the memory mapped since, while that is under a second old and
    /// leaves twice what makes pieces shrink (a device that roomy maps
    /// the largest pieces whatever it has free); else a new reading
    /// (`read`: `cuMemGetInfo`, about 5.5 µs on an H200, which a cold
    /// pass of the seq2seq log would otherwise make 479 times). Near the
    /// limit every map reads it.
    fn free_for_pieces(&self, read: &dyn Fn() -> usize) -> usize {
        let roomy = 2 * crate::upstream::FREE_PER_PIECE_BYTE * crate::upstream::REMAP_PIECE_MAX;
        {
            let seen = lock(&self.free_seen);
            let left = seen.free.saturating_sub(seen.made);
            if seen.at.is_some_and(|at| at.elapsed() < std::time::Duration::from_secs(1)) && left >= roomy {
                return left;
            }
        }
        let free = read();
        *lock(&self.free_seen) = super::FreeSeen { at: Some(std::time::Instant::now()), free, made: 0 };
        free
    }

    /// Maps each of `runs` with new pieces sized for `free` bytes free.
    fn map_each(&self, runs: &[Chunk], kind: PoolKind, free: usize) -> Result<u64> {
        let mut calls = 0;
        for (i, run) in runs.iter().enumerate() {
            let r = match self.offset_of(*run) {
                Some(offset) => self.map_one_run(offset, run.size, free),
                None => Err(Error::InvalidState(format!("run {:#x}+{} is outside the segment", run.addr, run.size))),
            };
            match r {
                Ok(n) => calls += n,
                Err(e) => {
                    let released = {
                        let mut region = lock(&self.region);
                        for done in &runs[..i] {
                            if let Some(offset) = self.offset_of(*done) {
                                let _ = region.unmap_inside(offset, done.size);
                            }
                        }
                        region.release_spare()
                    };
                    drop(released);
                    return Err(if vmm::is_out_of_memory(&e) { self.oom(run.size, e.to_string(), kind) } else { e });
                }
            }
        }
        // Unused spares stay for the next map (`kept`).
        Ok(calls)
    }

    /// Maps one run. On CUDA the driver calls run with the region's lock
    /// dropped (`RunMap`); host memory maps under the lock. Spare memory
    /// that another move lent behind a fence that has not passed is taken
    /// only after a wait for that fence, with the lock dropped (the pool
    /// holds its remap lock: the spares stay as they are meanwhile). The
    /// fence is an event on a stream that does not capture: a capture
    /// under way elsewhere is not broken by the wait (relaxed capture
    /// mode, as for the mapper's waits).
    fn map_one_run(&self, offset: usize, size: usize, device_free: usize) -> Result<u64> {
        loop {
            let fence = lock(&self.region).fence_before_map(size);
            match fence {
                Some(fence) => fence.wait()?,
                None => break,
            }
        }
        let plan = {
            let mut region = lock(&self.region);
            // Old mappings of moved memory there are being unmapped
            // behind another thread's back: a map there waits for them.
            let mut attempt = 0;
            while region.stale_busy_in(offset, offset + size) {
                drop(region);
                crate::sync::backoff(attempt);
                attempt = attempt.saturating_add(1);
                region = lock(&self.region);
            }
            match region.plan_run(offset, size, device_free)? {
                Some(plan) => plan,
                None => return region.map_run(offset, size, device_free),
            }
        };
        let done = plan.execute();
        lock(&self.region).finish_run(done)
    }

    pub(super) fn unmap_within(&self, spans: &[Chunk], want: usize, pending: bool, keep: bool) -> Result<Vec<Chunk>> {
        let offsets: Vec<(usize, usize)> =
            spans.iter().filter_map(|c| self.offset_of(*c).map(|o| (o, c.size))).collect();
        // Work on a peer's streams may use the memory too.
        let wait_for_peers = |peers: &[usize]| if pending { synchronize_peers(peers) } else { Ok(()) };
        // On CUDA the waits and driver calls run with the region's lock
        // dropped (`RunUnmap`); host memory unmaps under the lock.
        let plan = {
            let mut region = lock(&self.region);
            match region.plan_unmap(&offsets, want, pending, keep) {
                Planned::Nothing => return Ok(Vec::new()),
                Planned::Unlocked(plan) => plan,
                Planned::Locked => {
                    wait_for_peers(region.peers())?;
                    let out = region.unmap_within(&offsets, want, pending, keep)?;
                    return Ok(self.chunks_at(out));
                }
            }
        };
        let peers = plan.peers.clone();
        let done = plan.execute(|| wait_for_peers(&peers));
        let (out, released) = lock(&self.region).finish_unmap(done)?;
        drop(released);
        Ok(self.chunks_at(out))
    }

    /// Lends the memory of whole pieces inside `spans` to the next map
    /// without unmapping it (`Region::lend_within`); `None` where the
    /// region can't. Work that may use the spans ([`Queued`]) is waited
    /// for first, as [`unmap_within`](Self::unmap_within) waits (the
    /// device and its peers), unless it is ordered before the new owner's
    /// on one stream and no peer maps the region: the old mappings then
    /// wait for the fence instead.
    pub(super) fn lend_within(&self, spans: &[Chunk], want: usize, queued: Queued) -> Option<Result<Vec<Chunk>>> {
        let offsets: Vec<(usize, usize)> =
            spans.iter().filter_map(|c| self.offset_of(*c).map(|o| (o, c.size))).collect();
        let (wait, fence) = match queued {
            Queued::Nothing => (false, None),
            Queued::Any => (true, None),
            // A peer's work may use the memory too, and a fence covers one
            // stream of this device.
            Queued::Before(fence) => match lock(&self.region).peers().is_empty() {
                true => (false, Some(fence)),
                false => (true, None),
            },
        };
        if wait {
            let (wait, peers) = {
                let region = lock(&self.region);
                (region.would_lend(&offsets, want)?, region.peers().to_vec())
            };
            // Waiting for the device would break a capture under way: lend
            // nothing (the pool grows instead).
            if captures_under_way() {
                return Some(Ok(Vec::new()));
            }
            // The caller holds the pool's remap lock and marked the spans
            // holes: the pieces there stay as they are meanwhile.
            let waited = wait.map_or(Ok(()), |ctx| vmm::synchronize(&ctx)).and_then(|()| synchronize_peers(&peers));
            if let Err(e) = waited {
                return Some(Err(e));
            }
        }
        let out = lock(&self.region).lend_within(&offsets, want, fence)?;
        Some(Ok(self.chunks_at(out)))
    }

    /// Unmaps at most `most` old mappings of lent memory with the
    /// region's lock dropped, waiting for their fences with `wait` and
    /// passing over those that have not passed without; returns how many.
    pub(super) fn unmap_stale(&self, most: usize, wait: bool) -> usize {
        let Some(plan) = lock(&self.region).plan_stale_unmap(most, wait) else { return 0 };
        let done = plan.execute();
        lock(&self.region).finish_stale_unmap(done)
    }

    pub(super) fn has_stale(&self) -> bool {
        lock(&self.region).has_stale()
    }

    /// Chunks at region offsets `(offset, size)`.
    fn chunks_at(&self, spans: Vec<(usize, usize)>) -> Vec<Chunk> {
        spans.into_iter().map(|(offset, size)| Chunk { addr: self.base + offset, size }).collect()
    }

    pub(super) fn release_kept(&self) {
        self.release(|region| {
            // A move that failed before its map ends here.
            region.end_move();
            region.release_spare()
        });
    }

    pub(super) fn kept(&self) -> usize {
        lock(&self.region).spare_bytes()
    }

    pub(super) fn trim_kept(&self, keep: usize) {
        self.release(|region| region.release_spare_over(keep));
    }

    /// Releases the kept memory `take` takes out of the region. Lent
    /// memory stays on the device until its old mapping goes: those that
    /// no queued work may use are unmapped here, the rest by the next map
    /// once their fences have passed ([`unmap_released`](Self::unmap_released)),
    /// or by the mapper thread.
    fn release(&self, take: impl FnOnce(&mut Region) -> Released) {
        let (released, unmap) = {
            let mut region = lock(&self.region);
            let released = take(&mut region);
            region.mark_released(&released);
            (released, region.plan_released_unmap())
        };
        drop(released);
        self.finish_unmap_released(unmap);
    }

    /// Unmaps the old mappings of released memory whose fences have passed
    /// (with the region's lock dropped): all that keeps that memory on the
    /// device.
    fn unmap_released(&self) {
        let unmap = lock(&self.region).plan_released_unmap();
        self.finish_unmap_released(unmap);
    }

    fn finish_unmap_released(&self, unmap: Option<StaleUnmap>) {
        if let Some(plan) = unmap {
            let done = plan.execute();
            lock(&self.region).finish_stale_unmap(done);
        }
    }

    pub(super) fn mapped_pieces(&self, addr: usize, size: usize) -> Option<Vec<Chunk>> {
        let offset = self.offset_of(Chunk { addr, size })?;
        let end = offset + size;
        let region = lock(&self.region);
        let mut pieces = Vec::new();
        let mut covered = offset;
        for (start, len) in region.piece_bounds() {
            if start + len <= offset {
                continue;
            }
            if start >= end {
                break;
            }
            // A gap before this piece: part of the span is not mapped.
            if start > covered {
                return None;
            }
            pieces.push(Chunk { addr: self.base + start, size: len });
            covered = start + len;
        }
        (size > 0 && covered >= end).then_some(pieces)
    }
}
