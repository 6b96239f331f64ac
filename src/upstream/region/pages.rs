//! Page remapping inside a region: mapping runs of pages with memory that
//! was unmapped elsewhere (no new allocation), and unmapping whole pieces
//! that lie in free space.
//!
//! # Implementation details
//! A piece is unmapped whole, as it was mapped (the driver can't unmap
//! part of a mapping). Its memory (on CUDA, the `cuMemCreate` handle) goes
//! to `spare` when the caller moves it, and the next [`Region::map_run`]
//! maps spares of at most the run's remaining size (largest first) before
//! it allocates new memory for the rest, in pieces of at most
//! [`remap_piece`](crate::upstream::remap_piece) of what the region maps,
//! so that a few pages of a large run can move later without the rest.
//! Spares a map did not use stay for later maps (the pool counts them as
//! held) until [`Region::release_spare`] or
//! [`Region::release_spare_over`]. Each piece is one `cuMemMap`; the
//! whole run gets one `cuMemSetAccess` for the owner and every granted
//! peer, so remapped memory is reachable from the same devices as the rest
//! of the region.
//!
//! On CUDA the driver calls of a map ([`RunMap`]) and of an unmap
//! ([`RunUnmap`], with the wait for the device before it) run with the
//! region's lock dropped, so the region's other users (the background
//! mapper's stale unmaps, readers of what is mapped and kept, peers being
//! given access) don't wait for the driver. Under the lock, a map's run
//! or an unmap's pieces are recorded in flight first (no other map takes
//! their addresses meanwhile), and the outcome is recorded after. Memory
//! released (`cuMemRelease`) leaves the region as [`Released`], dropped by
//! the caller once the lock is.

use super::{Backing, Piece, Region, Reservation, Space};
use crate::cuda::vmm::{self, PhysicalChunk, RangeAlias};
use crate::error::{Error, Result};
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// A run of pages being mapped with the region's lock dropped
/// ([`Region::plan_run`]): the driver calls (`cuMemCreate`, `cuMemMap`,
/// `cuMemSetAccess`) then don't hold up the region's other users. Its
/// pieces, spares taken for it and all, are the region's again in
/// [`Region::finish_run`].
pub(crate) struct RunMap {
    offset: usize,
    size: usize,
    /// The run's segment: its first offset, and its reservation under a
    /// name that never frees it.
    seg_off: usize,
    range: RangeAlias,
    /// The pieces in address order: offset, size, and the spare memory to
    /// map there (`None`: new memory of that size).
    pieces: Vec<(usize, usize, Option<Backing>)>,
    /// The peers given access when the run was planned.
    peers: Vec<usize>,
}

/// What [`RunMap::execute`] leaves for [`Region::finish_run`].
pub(crate) struct RunDone {
    offset: usize,
    size: usize,
    mapped: Vec<Piece>,
    spare: Vec<(usize, Backing)>,
    peers: Vec<usize>,
    seg_off: usize,
    result: Result<u64>,
}

impl RunMap {
    /// Creates the new memory, maps every piece and gives access, with no
    /// lock held. On failure nothing stays mapped, and every piece's
    /// memory goes back to the spares.
    pub(crate) fn execute(self) -> RunDone {
        let RunMap { offset, size, seg_off, range, pieces, peers } = self;
        let mut mapped = Vec::with_capacity(pieces.len());
        let mut spare = Vec::new();
        let mut failure = None;
        let ctx = range.context().clone();
        for (at, len, backing) in pieces {
            if failure.is_some() {
                if let Some(b) = backing {
                    spare.push((len, b));
                }
                continue;
            }
            let backing = match backing {
                Some(b) => b,
                None => match PhysicalChunk::create(&ctx, len) {
                    Ok(c) => Backing::Cuda(c),
                    Err(e) => {
                        failure = Some(e);
                        continue;
                    }
                },
            };
            let mapped_ok = match &backing {
                Backing::Cuda(chunk) => range.map(at - seg_off, chunk),
                Backing::Host => super::unreachable_backing(),
            };
            match mapped_ok {
                Ok(()) => mapped.push(Piece { offset: at, size: len, backing }),
                Err(e) => {
                    spare.push((len, backing));
                    failure = Some(e);
                }
            }
        }
        if failure.is_none() {
            failure = range.set_access(offset - seg_off, size, &peers).err();
        }
        let calls = mapped.len() as u64;
        let result = match failure {
            None => Ok(calls),
            Some(e) => {
                for piece in mapped.drain(..) {
                    if let Err(u) = range.unmap(piece.offset - seg_off, piece.size) {
                        eprintln!("cumem: unmapping {} B at offset {}: {u}", piece.size, piece.offset);
                    }
                    spare.push((piece.size, piece.backing));
                }
                Err(e)
            }
        };
        RunDone { offset, size, mapped, spare, peers, seg_off, result }
    }
}

/// What [`Region::plan_unmap`] decided.
pub(crate) enum Planned {
    /// No whole piece lies in the spans.
    Nothing,
    /// The unmap must run under the lock ([`Region::unmap_within`]).
    Locked,
    /// Pieces to unmap with the lock dropped.
    Unlocked(RunUnmap),
}

/// Pieces being unmapped with the region's lock dropped
/// ([`Region::plan_unmap`]). They are off the region's list, and maps
/// keep off their addresses, until [`Region::finish_unmap`].
pub(crate) struct RunUnmap {
    seg_off: usize,
    range: RangeAlias,
    pieces: Vec<Piece>,
    /// The context to wait for first (work queued on it may use the
    /// memory).
    sync: Option<Arc<CudaContext>>,
    keep: bool,
    /// The devices given access to the region when the unmap was planned.
    pub(crate) peers: Vec<usize>,
}

/// What [`RunUnmap::execute`] leaves for [`Region::finish_unmap`].
pub(crate) struct UnmapDone {
    pieces: Vec<Piece>,
    keep: bool,
    result: Result<()>,
}

/// Memory taken out of a region, released (`cuMemRelease`) when this is
/// dropped: by the caller, once the region's lock is dropped.
#[must_use = "dropping it releases the memory: drop it with the region's lock released"]
pub(crate) struct Released(Vec<Backing>);

impl Released {
    /// The handles of the device memory released.
    pub(super) fn handles(&self) -> Vec<u64> {
        self.0.iter().filter_map(Backing::handle).collect()
    }
}

impl RunUnmap {
    /// Runs `wait_first` (the caller's waits for peers), waits for the
    /// device if the plan says so, then unmaps every piece, with no lock
    /// held. A failed wait unmaps nothing. An unmap that fails is logged:
    /// the piece is gone either way, as under the lock.
    pub(crate) fn execute(self, wait_first: impl FnOnce() -> Result<()>) -> UnmapDone {
        let RunUnmap { seg_off, range, pieces, sync, keep, .. } = self;
        let waited = wait_first().and_then(|()| sync.map_or(Ok(()), |ctx| vmm::synchronize(&ctx)));
        if waited.is_ok() {
            for piece in &pieces {
                if let Err(e) = range.unmap(piece.offset - seg_off, piece.size) {
                    eprintln!("cumem: unmapping {} B at offset {}: {e}", piece.size, piece.offset);
                }
            }
        }
        UnmapDone { pieces, keep, result: waited }
    }
}

impl Region {
    /// Maps memory over `[offset, offset + size)` (granularity multiples,
    /// unmapped, inside one segment): spares first, new memory for the
    /// rest, in pieces sized for `device_free` bytes free on the device
    /// ([`remap_piece`](crate::upstream::remap_piece)). Returns the number
    /// of map calls. On failure nothing new stays mapped (spares used go
    /// back to the spares).
    pub(crate) fn map_run(&mut self, offset: usize, size: usize, device_free: usize) -> Result<u64> {
        let end = self.run_end(offset, size)?;
        let s = self.segment_of(offset);
        let seg_off = self.segments[s].offset;
        if seg_off + self.segments[s].res.size() < end {
            // Runs crossing reservations (only growable buffers have
            // several) go through the plain path.
            self.map(offset, size)?;
            return Ok(1);
        }
        self.unmap_stale_in(offset, end)?;
        let at = self.check_unmapped(offset, end)?;
        let piece_cap = self.piece_cap(device_free);
        let mut new: Vec<Piece> = Vec::new();
        let mut cursor = offset;
        let mut failure = None;
        while cursor < end {
            let rem = end - cursor;
            let (len, backing) = match self.take_spare(rem) {
                Some(spare) => spare,
                None => match self.new_backing(rem.min(piece_cap)) {
                    Ok(b) => (rem.min(piece_cap), b),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                },
            };
            let piece = Piece { offset: cursor, size: len, backing };
            if let Err(e) = self.map_backing(&piece, cursor - seg_off) {
                self.spare.push((piece.size, piece.backing));
                failure = Some(e);
                break;
            }
            cursor += len;
            new.push(piece);
        }
        if failure.is_none() {
            if let Reservation::Cuda(range) = &self.segments[s].res {
                failure = range.set_access(offset - seg_off, size, &self.peers).err();
            }
        }
        let calls = new.len() as u64;
        if let Some(e) = failure {
            for piece in new {
                self.unmap_piece(&piece);
                self.spare.push((piece.size, piece.backing));
            }
            return Err(e);
        }
        self.pieces.splice(at..at, new);
        Ok(calls)
    }

    /// With the lock held: plans the map of `[offset, offset + size)` (as
    /// [`map_run`](Self::map_run) would map it: the spares first,
    /// largest first, new memory in pieces for the rest) for
    /// [`RunMap::execute`] to carry out with the lock dropped, and keeps
    /// other maps off the run meanwhile. `Ok(None)` where the run must be
    /// mapped under the lock ([`map_run`](Self::map_run)): host memory, or
    /// a run across segments. `device_free`: as for `map_run`.
    pub(crate) fn plan_run(&mut self, offset: usize, size: usize, device_free: usize) -> Result<Option<RunMap>> {
        let end = self.run_end(offset, size)?;
        self.unmap_stale_in(offset, end)?;
        let s = self.segment_of(offset);
        let seg_off = self.segments[s].offset;
        let Reservation::Cuda(range) = &self.segments[s].res else { return Ok(None) };
        if seg_off + range.size() < end {
            return Ok(None);
        }
        self.check_unmapped(offset, end)?;
        // SAFETY: the alias is used only by this map, while the caller
        // holds the region (its `SharedRegion`), which keeps its
        // reservation.
        let range = unsafe { range.alias() };
        let piece_cap = self.piece_cap(device_free);
        let mut pieces = Vec::new();
        let mut cursor = offset;
        while cursor < end {
            let rem = end - cursor;
            let (len, backing) = match self.take_spare(rem) {
                Some((len, backing)) => (len, Some(backing)),
                None => (rem.min(piece_cap), None),
            };
            pieces.push((cursor, len, backing));
            cursor += len;
        }
        self.in_flight.push((offset, size));
        Ok(Some(RunMap { offset, size, seg_off, range, pieces, peers: self.peers.clone() }))
    }

    /// With the lock held again: records what [`RunMap::execute`] mapped
    /// (and gives access to peers granted meanwhile), or takes the memory
    /// of a failed run back as spares. Returns the map calls made.
    ///
    /// # Errors
    /// The run's error (nothing of it stays mapped).
    pub(crate) fn finish_run(&mut self, done: RunDone) -> Result<u64> {
        let RunDone { offset, size, mapped, spare, peers, seg_off, result } = done;
        self.in_flight.retain(|&r| r != (offset, size));
        self.spare.extend(spare);
        let calls = result?;
        let at = self.pieces.partition_point(|p| p.offset < offset);
        self.pieces.splice(at..at, mapped);
        if self.peers != peers {
            let s = self.segment_of(offset);
            debug_assert_eq!(self.segments[s].offset, seg_off);
            if let Reservation::Cuda(range) = &self.segments[s].res {
                range.set_access(offset - seg_off, size, &self.peers)?;
            }
        }
        Ok(calls)
    }

    /// The end of a run of `size` bytes at `offset`: granularity
    /// multiples, not empty, inside the reservation.
    fn run_end(&self, offset: usize, size: usize) -> Result<usize> {
        let gran = self.granularity();
        let end = offset.checked_add(size).filter(|e| *e <= self.reserved() && size > 0);
        end.filter(|_| offset % gran == 0 && size % gran == 0)
            .ok_or_else(|| Error::InvalidState(format!("can't map a run of {size} B at offset {offset}")))
    }

    /// Where a run `[offset, end)` goes among the pieces, when nothing is
    /// mapped there nor being mapped.
    fn check_unmapped(&self, offset: usize, end: usize) -> Result<usize> {
        let at = self.pieces.partition_point(|p| p.offset < offset);
        let overlaps_prev = at > 0 && self.pieces[at - 1].offset + self.pieces[at - 1].size > offset;
        let in_flight = self.in_flight.iter().chain(&self.stale_busy).any(|&(o, l)| o < end && offset < o + l);
        if overlaps_prev || self.pieces.get(at).is_some_and(|p| p.offset < end) || in_flight {
            return Err(Error::InvalidState(format!("offset {offset} (+{} B) is already mapped", end - offset)));
        }
        Ok(at)
    }

    /// The largest piece of new memory a map makes now, with
    /// `device_free` bytes free on the device.
    fn piece_cap(&self, device_free: usize) -> usize {
        let mapped: usize = self.pieces.iter().map(|p| p.size).sum();
        crate::upstream::remap_piece(mapped, device_free).next_multiple_of(self.granularity())
    }

    /// The largest spare of at most `rem` bytes, taken.
    fn take_spare(&mut self, rem: usize) -> Option<(usize, Backing)> {
        let pick = self.pick_spare(rem, |_| false)?;
        Some(self.spare.swap_remove(pick))
    }

    fn new_backing(&self, size: usize) -> Result<Backing> {
        match &self.space {
            super::Space::Cuda { ctx, .. } => Ok(Backing::Cuda(PhysicalChunk::create(ctx, size)?)),
            super::Space::Host { .. } => Ok(Backing::Host),
        }
    }

    /// Maps one piece's memory at `seg_offset` of its segment (no access
    /// set yet on CUDA; committed on the host).
    fn map_backing(&self, piece: &Piece, seg_offset: usize) -> Result<()> {
        let seg = &self.segments[self.segment_of(piece.offset)];
        match (&seg.res, &piece.backing) {
            (Reservation::Cuda(range), Backing::Cuda(chunk)) => range.map(seg_offset, chunk),
            (Reservation::Host(range), Backing::Host) => range.commit(seg_offset, piece.size),
            _ => super::unreachable_backing(),
        }
    }

    /// Unmaps whole pieces lying inside the spans `(offset, size)`, in the
    /// order given, until at least `want` bytes are unmapped; returns them
    /// as `(offset, size)`. Within a span, pieces no larger than what is
    /// still wanted go first. With `sync`, waits for the device first.
    /// With `keep`, their memory becomes spare for
    /// [`map_run`](Self::map_run); else it is released.
    pub(crate) fn unmap_within(
        &mut self,
        spans: &[(usize, usize)],
        want: usize,
        sync: bool,
        keep: bool,
    ) -> Result<Vec<(usize, usize)>> {
        let chosen = self.chosen_pieces(spans, want);
        if chosen.is_empty() {
            return Ok(Vec::new());
        }
        if sync {
            self.synchronize()?;
        }
        let mut out = Vec::with_capacity(chosen.len());
        for piece in self.take_pieces(chosen) {
            self.unmap_piece(&piece);
            out.push((piece.offset, piece.size));
            if keep {
                self.spare.push((piece.size, piece.backing));
            }
        }
        Ok(out)
    }

    /// The indexes of the pieces [`choose_pieces`] picks among the
    /// region's, in address order.
    pub(super) fn chosen_pieces(&self, spans: &[(usize, usize)], want: usize) -> Vec<usize> {
        let bounds: Vec<(usize, usize)> = self.pieces.iter().map(|p| (p.offset, p.size)).collect();
        let mut chosen = choose_pieces(&bounds, spans, want);
        chosen.sort_unstable();
        chosen
    }

    /// Takes the pieces at `chosen` (indexes in address order) off the
    /// region's list, in address order.
    pub(super) fn take_pieces(&mut self, chosen: Vec<usize>) -> Vec<Piece> {
        let mut pieces: Vec<Piece> = chosen.into_iter().rev().map(|i| self.pieces.remove(i)).collect();
        pieces.reverse();
        pieces
    }

    /// With the lock held: chooses the pieces [`unmap_within`](Self::unmap_within)
    /// would unmap, takes them off the region's list and keeps maps off
    /// their addresses, for [`RunUnmap::execute`] to unmap with the lock
    /// dropped (the unmaps, and the wait for the device before them, then
    /// don't hold up the region's other users).
    /// [`Planned::Nothing`] when no whole piece lies in the spans;
    /// [`Planned::Locked`] where the unmap must run under the lock (host
    /// memory, several segments).
    pub(crate) fn plan_unmap(&mut self, spans: &[(usize, usize)], want: usize, sync: bool, keep: bool) -> Planned {
        let Space::Cuda { ctx, .. } = &self.space else { return Planned::Locked };
        let [seg] = &self.segments[..] else { return Planned::Locked };
        let Reservation::Cuda(range) = &seg.res else { return Planned::Locked };
        let chosen = self.chosen_pieces(spans, want);
        if chosen.is_empty() {
            return Planned::Nothing;
        }
        let (seg_off, ctx) = (seg.offset, ctx.clone());
        // SAFETY: the alias is used only by this unmap, while the caller
        // holds the region (its `SharedRegion`), which keeps its
        // reservation.
        let range = unsafe { range.alias() };
        let pieces = self.take_pieces(chosen);
        self.in_flight.extend(pieces.iter().map(|p| (p.offset, p.size)));
        let sync = (sync && !self.owner_settles).then_some(ctx);
        Planned::Unlocked(RunUnmap { seg_off, range, pieces, sync, keep, peers: self.peers.clone() })
    }

    /// With the lock held again: records what [`RunUnmap::execute`] did.
    /// The pieces' memory becomes spare (`keep`), or is
    /// returned for the caller to release with the lock dropped. After a
    /// failed wait nothing was unmapped, and the pieces are the region's
    /// again.
    ///
    /// # Errors
    /// The wait's error.
    pub(crate) fn finish_unmap(&mut self, done: UnmapDone) -> Result<(Vec<(usize, usize)>, Released)> {
        let UnmapDone { pieces, keep, result } = done;
        self.in_flight.retain(|r| !pieces.iter().any(|p| (p.offset, p.size) == *r));
        if let Err(e) = result {
            for piece in pieces {
                let at = self.pieces.partition_point(|p| p.offset < piece.offset);
                self.pieces.insert(at, piece);
            }
            return Err(e);
        }
        let out = pieces.iter().map(|p| (p.offset, p.size)).collect();
        let mut released = Released(Vec::new());
        for piece in pieces {
            if keep {
                self.spare.push((piece.size, piece.backing));
            } else {
                released.0.push(piece.backing);
            }
        }
        Ok((out, released))
    }

    /// Unmaps and releases every piece inside `[offset, offset + size)`
    /// after waiting for the device; returns the bytes unmapped. Nothing
    /// changes when a piece crosses the span's edge.
    pub(crate) fn unmap_inside(&mut self, offset: usize, size: usize) -> Result<Option<usize>> {
        let end = offset.saturating_add(size);
        let first = self.pieces.partition_point(|p| p.offset < offset);
        let last = self.pieces.partition_point(|p| p.offset < end);
        let cut_before = first > 0 && self.pieces[first - 1].offset + self.pieces[first - 1].size > offset;
        let cut_after = last > first && self.pieces[last - 1].offset + self.pieces[last - 1].size > end;
        if cut_before || cut_after || size == 0 {
            return Ok(None);
        }
        if last > first {
            self.synchronize()?;
        }
        // Old mappings there go too (a failed wait for one changes nothing).
        self.unmap_stale_in(offset, end)?;
        let removed: Vec<Piece> = self.pieces.drain(first..last).collect();
        let mut bytes = 0;
        for piece in &removed {
            self.unmap_piece(piece);
            bytes += piece.size;
        }
        Ok(Some(bytes))
    }

    /// Takes the spare memory out of the region, for the caller to
    /// release (`cuMemRelease` on CUDA) once the lock is dropped.
    pub(crate) fn release_spare(&mut self) -> Released {
        Released(self.spare.drain(..).map(|(_, b)| b).collect())
    }

    /// Takes spare memory out of the region, largest first, until at most
    /// `keep` bytes of it remain, for the caller to release once the lock
    /// is dropped.
    pub(crate) fn release_spare_over(&mut self, keep: usize) -> Released {
        let mut total = self.spare_bytes();
        let mut released = Released(Vec::new());
        // The largest last.
        self.spare.sort_by_key(|&(size, _)| size);
        while total > keep {
            let Some((size, backing)) = self.spare.pop() else { break };
            released.0.push(backing);
            total -= size;
        }
        released
    }

    /// The index of the largest spare of at most `rem` bytes, passing
    /// over those `taken` says a map took already.
    fn pick_spare(&self, rem: usize, taken: impl Fn(usize) -> bool) -> Option<usize> {
        (0..self.spare.len()).filter(|&i| self.spare[i].0 <= rem && !taken(i)).max_by_key(|&i| self.spare[i].0)
    }

    /// A fence that a map of a run of `size` bytes must wait for first:
    /// one the spare memory it would take was lent behind, that has not
    /// passed and is not the move's under way
    /// ([`unready_fence`](Region::unready_fence)). Nothing to look at
    /// (no driver call) while no lent memory keeps an old mapping.
    pub(crate) fn fence_before_map(&self, size: usize) -> Option<Arc<dyn crate::tag::Fence>> {
        if self.stale.is_empty() {
            return None;
        }
        let mut taken = Vec::new();
        let mut rem = size;
        while let Some(i) = self.pick_spare(rem, |i| taken.contains(&i)) {
            if let Some(fence) = self.unready_fence(&self.spare[i].1) {
                return Some(fence);
            }
            rem -= self.spare[i].0;
            taken.push(i);
        }
        None
    }

    /// The bytes of spare memory (unmapped, kept for the next map).
    pub(crate) fn spare_bytes(&self) -> usize {
        self.spare.iter().map(|s| s.0).sum()
    }
}

/// Which of `pieces` (`(offset, size)`, sorted, disjoint) to unmap: whole
/// pieces inside the spans, span by span in the order given, until at
/// least `want` bytes; within a span the pieces no larger than what is
/// still wanted go first (largest first), then the smallest of the rest.
/// Returns indices into `pieces`.
pub fn choose_pieces(pieces: &[(usize, usize)], spans: &[(usize, usize)], want: usize) -> Vec<usize> {
    let mut chosen = Vec::new();
    let mut got = 0usize;
    for &(start, len) in spans {
        if got >= want {
            break;
        }
        let end = start.saturating_add(len);
        let first = pieces.partition_point(|p| p.0 < start);
        let last = pieces.partition_point(|p| p.0 < end);
        let mut inside: Vec<usize> = (first..last).filter(|&i| pieces[i].0 + pieces[i].1 <= end).collect();
        inside.sort_by_key(|&i| {
            let size = pieces[i].1;
            if size <= want - got {
                (0, usize::MAX - size)
            } else {
                (1, size)
            }
        });
        for i in inside {
            if got >= want {
                break;
            }
            got += pieces[i].1;
            chosen.push(i);
        }
    }
    chosen
}
