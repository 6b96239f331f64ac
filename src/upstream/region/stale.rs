//! Stale mappings: the old places of memory lent to a map elsewhere.
//!
//! # Implementation details
//! Page remapping moves memory without unmapping it first
//! ([`Region::lend_within`]): the pieces leave the region's list and
//! become spare, for the next map to map at their new addresses, while
//! they stay mapped where they were. Each old mapping is a [`Stale`]
//! entry, which maps keep off. It is unmapped behind the allocating
//! thread ([`Region::plan_stale_unmap`], then [`StaleUnmap::execute`]
//! with the region's lock dropped and [`Region::finish_stale_unmap`]),
//! or first by a map that needs its addresses
//! ([`Region::unmap_stale_in`]), or when the region gives its memory
//! back. A mapping lent before a fence (work queued on the stream the
//! memory is lent for) is unmapped only once the fence has passed.

use super::pages::Released;
use super::{Region, Reservation, Space};
use crate::cuda::vmm::RangeAlias;
use crate::error::Result;
use crate::tag::Fence;
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// An old mapping of lent memory ([`Region::lend_within`]).
#[derive(Clone)]
pub(crate) struct Stale {
    pub(super) offset: usize,
    pub(super) size: usize,
    /// Work queued before it may still use the mapping (`None`: none).
    pub(super) fence: Option<Arc<dyn Fence>>,
    /// The memory's handle (`None`: host memory).
    pub(super) memory: Option<u64>,
    /// Whether the memory was released while this mapping stayed: it is
    /// freed on the device only once the mapping goes
    /// ([`plan_released_unmap`](Region::plan_released_unmap)).
    pub(super) released: bool,
}

impl std::fmt::Debug for Stale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stale({}+{}{})", self.offset, self.size, if self.fence.is_some() { ", fenced" } else { "" })
    }
}

/// The fences of the move under way ([`Region::unready_fence`]).
#[derive(Default)]
pub(super) struct Lending(Vec<Arc<dyn Fence>>);

impl Lending {
    fn has(&self, fence: &Arc<dyn Fence>) -> bool {
        self.0.iter().any(|l| Arc::ptr_eq(l, fence))
    }
}

impl std::fmt::Debug for Lending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lending({} fences)", self.0.len())
    }
}

impl Region {
    /// Lends memory without unmapping it: the whole pieces inside the
    /// spans that [`unmap_within`](Self::unmap_within) would unmap (until
    /// at least `want` bytes) leave the region's list and become spare,
    /// for the next map to map at new addresses, while they stay mapped
    /// where they were (a stale mapping, which maps keep off)
    /// until [`plan_stale_unmap`](Self::plan_stale_unmap) or a map that
    /// needs those addresses unmaps them. No driver call. The caller
    /// lends only memory no queued work may use (`fence: None`), or that
    /// only work queued before `fence` may use, on the stream the memory
    /// is lent for: after the lend, work through the old addresses
    /// reaches the new owner's memory, so it must run before the new
    /// owner's. A mapping lent before a fence stays until the fence has
    /// passed. `None` where the region can't lend (host memory, several
    /// segments): the caller unmaps instead.
    pub(crate) fn lend_within(
        &mut self,
        spans: &[(usize, usize)],
        want: usize,
        fence: Option<Arc<dyn Fence>>,
    ) -> Option<Vec<(usize, usize)>> {
        let Space::Cuda { .. } = &self.space else { return None };
        if self.segments.len() != 1 {
            return None;
        }
        let chosen = self.chosen_pieces(spans, want);
        if let Some(f) = fence.as_ref().filter(|f| !self.lending.has(f)) {
            self.lending.0.push(f.clone());
        }
        let mut out = Vec::with_capacity(chosen.len());
        for piece in self.take_pieces(chosen) {
            out.push((piece.offset, piece.size));
            let memory = piece.backing.handle();
            let m = Stale { offset: piece.offset, size: piece.size, fence: fence.clone(), memory, released: false };
            self.stale.push(m);
            self.spare.push((piece.size, piece.backing));
        }
        Some(out)
    }

    /// Whether [`lend_within`](Self::lend_within) would lend anything,
    /// and if so the context to wait for first when queued work may use
    /// the memory (`None`: no wait, the owner settles its own work).
    pub(crate) fn would_lend(&self, spans: &[(usize, usize)], want: usize) -> Option<Option<Arc<CudaContext>>> {
        let Space::Cuda { ctx, .. } = &self.space else { return None };
        if self.segments.len() != 1 || self.chosen_pieces(spans, want).is_empty() {
            return None;
        }
        Some((!self.owner_settles).then(|| ctx.clone()))
    }

    /// The fence spare memory must wait for before a map takes it, if
    /// any: one of its old mappings was lent behind a fence that has not
    /// passed and is not the move's under way (whose map's stream waits
    /// for it on the device). Memory a move lent and did not map is still
    /// reached by the work queued before its fence, and a later map may
    /// be for another stream, whose work could run beside that work.
    pub(super) fn unready_fence(&self, backing: &super::Backing) -> Option<Arc<dyn Fence>> {
        let handle = backing.handle()?;
        let mut fences = self.stale.iter().filter(|m| m.memory == Some(handle)).filter_map(|m| m.fence.as_ref());
        fences.find(|f| !self.lending.has(f) && !f.passed()).cloned()
    }

    /// The move under way is over (its map made or failed): what it lent
    /// and did not map waits for its fences like the rest.
    pub(crate) fn end_move(&mut self) {
        self.lending.0.clear();
    }

    /// Whether stale mappings wait to be unmapped.
    pub(crate) fn has_stale(&self) -> bool {
        !self.stale.is_empty()
    }

    /// Whether a stale mapping inside `[offset, end)` is being unmapped
    /// with the lock dropped (a map there waits for it).
    pub(crate) fn stale_busy_in(&self, offset: usize, end: usize) -> bool {
        self.stale_busy.iter().any(|&(o, l)| o < end && offset < o + l)
    }

    /// With the lock held: takes at most `most` stale mappings for
    /// [`StaleUnmap::execute`] to unmap with the lock dropped; maps keep
    /// off their addresses until [`finish_stale_unmap`](Self::finish_stale_unmap).
    /// Mappings whose fence has not passed are taken with `wait` (the
    /// execution waits for them) and passed over without.
    pub(crate) fn plan_stale_unmap(&mut self, most: usize, wait: bool) -> Option<StaleUnmap> {
        self.plan_stale_unmap_of(most, wait, |_| true)
    }

    /// Notes that the memory in `released` is being released: its stale
    /// mappings are all that keep it on the device.
    pub(crate) fn mark_released(&mut self, released: &Released) {
        let handles = released.handles();
        for m in &mut self.stale {
            m.released |= m.memory.is_some_and(|h| handles.contains(&h));
        }
    }

    /// With the lock held: the stale mappings of released memory whose
    /// fences have passed, for [`StaleUnmap::execute`]. Released memory is
    /// freed only once its last mapping goes, so these go on the thread
    /// that releases or maps memory, not behind it: the device's free
    /// memory then follows what the pool counts, whenever the mapper runs.
    /// Mappings behind a fence that has not passed wait for the next call.
    pub(crate) fn plan_released_unmap(&mut self) -> Option<StaleUnmap> {
        self.plan_stale_unmap_of(usize::MAX, false, |m| m.released)
    }

    /// [`plan_stale_unmap`](Self::plan_stale_unmap) of the mappings `pick`
    /// chooses.
    fn plan_stale_unmap_of(&mut self, most: usize, wait: bool, pick: impl Fn(&Stale) -> bool) -> Option<StaleUnmap> {
        if self.stale.is_empty() {
            return None;
        }
        let [seg] = &self.segments[..] else { return None };
        let Reservation::Cuda(range) = &seg.res else { return None };
        let mut maps = Vec::new();
        let mut i = 0;
        // The mappings one move lent share its fence: one that has not
        // passed is asked once.
        let mut waiting: Option<Arc<dyn Fence>> = None;
        while i < self.stale.len() && maps.len() < most {
            let ready = pick(&self.stale[i])
                && (wait
                    || match &self.stale[i].fence {
                        None => true,
                        Some(f) if waiting.as_ref().is_some_and(|w| Arc::ptr_eq(w, f)) => false,
                        Some(f) => {
                            let passed = f.passed();
                            if !passed {
                                waiting = Some(f.clone());
                            }
                            passed
                        }
                    });
            if ready {
                maps.push(self.stale.remove(i));
            } else {
                i += 1;
            }
        }
        if maps.is_empty() {
            return None;
        }
        // SAFETY: the alias is used only by this unmap, while the caller
        // holds the region (its `SharedRegion`), which keeps its
        // reservation (a
        // region with stale mappings has one segment and never remaps).
        let range = unsafe { range.alias() };
        self.stale_busy.extend(maps.iter().map(|m| (m.offset, m.size)));
        Some(StaleUnmap { seg_off: seg.offset, range, maps })
    }

    /// With the lock held again: what [`StaleUnmap::execute`] unmapped is
    /// gone, and what it could not (a failed wait) is stale again;
    /// returns how many went.
    pub(crate) fn finish_stale_unmap(&mut self, done: StaleDone) -> usize {
        let StaleDone { unmapped, kept } = done;
        self.stale_busy
            .retain(|&(o, l)| !unmapped.contains(&(o, l)) && !kept.iter().any(|k| (k.offset, k.size) == (o, l)));
        self.stale.extend(kept);
        unmapped.len()
    }

    /// Unmaps the stale mappings inside `[offset, end)` now, under the
    /// lock (a map needs their addresses, or the memory there goes),
    /// first waiting for the fences that have not passed. Unmap errors
    /// are logged: the mapping is gone either way.
    ///
    /// # Errors
    /// A failed wait: the mappings inside stay, as they were.
    pub(super) fn unmap_stale_in(&mut self, offset: usize, end: usize) -> Result<()> {
        if self.stale.is_empty() {
            return Ok(());
        }
        let (inside, rest): (Vec<Stale>, Vec<Stale>) =
            std::mem::take(&mut self.stale).into_iter().partition(|m| m.offset < end && offset < m.offset + m.size);
        self.stale = rest;
        for m in inside.iter().filter_map(|m| m.fence.as_ref()) {
            if !m.passed() {
                if let Err(e) = m.wait() {
                    self.stale.extend(inside);
                    return Err(e);
                }
            }
        }
        for m in inside {
            let seg = &self.segments[self.segment_of(m.offset)];
            if let Reservation::Cuda(range) = &seg.res {
                if let Err(e) = range.unmap(m.offset - seg.offset, m.size) {
                    eprintln!("cumem: unmapping {} B of moved memory at offset {}: {e}", m.size, m.offset);
                }
            }
        }
        Ok(())
    }
}

/// Stale mappings being unmapped with the region's lock dropped
/// ([`Region::plan_stale_unmap`]).
pub(crate) struct StaleUnmap {
    seg_off: usize,
    range: RangeAlias,
    maps: Vec<Stale>,
}

/// What [`StaleUnmap::execute`] did.
pub(crate) struct StaleDone {
    /// Unmapped: `(offset, size)`.
    unmapped: Vec<(usize, usize)>,
    /// Not unmapped: the wait for their fence failed.
    kept: Vec<Stale>,
}

impl StaleUnmap {
    /// Unmaps every stale mapping (no lock held), each once its fence has
    /// passed (waited for); returns them for [`Region::finish_stale_unmap`].
    /// Unmap errors are logged: the mapping is gone either way, and its
    /// memory is mapped elsewhere. A mapping whose wait fails stays.
    pub(crate) fn execute(self) -> StaleDone {
        let mut done = StaleDone { unmapped: Vec::with_capacity(self.maps.len()), kept: Vec::new() };
        for m in self.maps {
            if let Some(fence) = &m.fence {
                if !fence.passed() {
                    if let Err(e) = fence.wait() {
                        eprintln!(
                            "cumem: waiting for the work on {} B of moved memory at offset {}: {e}",
                            m.size, m.offset
                        );
                        done.kept.push(m);
                        continue;
                    }
                }
            }
            if let Err(e) = self.range.unmap(m.offset - self.seg_off, m.size) {
                eprintln!("cumem: unmapping {} B of moved memory at offset {}: {e}", m.size, m.offset);
            }
            done.unmapped.push((m.offset, m.size));
        }
        done
    }
}
