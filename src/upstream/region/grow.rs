//! Growing a region's reservation: in place when the addresses after it
//! are free, otherwise by remapping every piece into a new, larger range.

use super::{unreachable_backing, Backing, GrowPath, Region, Reservation, Segment, Waiter};
use crate::error::Result;

impl Region {
    /// Grows the reservation to at least `new_size` bytes: in place when the
    /// addresses after it are free, otherwise by remapping every piece into a
    /// new range. Mapped memory keeps its offsets and contents.
    pub(crate) fn grow_reservation(&mut self, new_size: usize) -> Result<GrowPath> {
        let old = self.reserved();
        let new_size = self.round(new_size)?;
        if new_size <= old {
            return Ok(GrowPath::Unchanged);
        }
        // Old mappings of lent memory go first (regions that lend never
        // grow: pools reserve once).
        self.unmap_stale_in(0, usize::MAX)?;
        // Give the guard's addresses back to extend into them at once.
        self.guard = None;
        let end = self.base.checked_add(old);
        if let Some(end) = end {
            // A refused hint is not an error: fall back to remapping.
            if let Ok(ext) = Reservation::new(&self.space, new_size - old, end) {
                if ext.addr() == end {
                    self.segments.push(Segment { offset: old, res: ext });
                    self.place_guard();
                    return Ok(GrowPath::InPlace);
                }
            }
        }
        let remapped = self.remap(new_size);
        self.place_guard();
        remapped?;
        Ok(GrowPath::Remapped)
    }

    fn remap(&mut self, new_size: usize) -> Result<()> {
        let mut fresh = self.fresh_reservation(new_size)?;
        match &mut fresh {
            Reservation::Cuda(new_range) => {
                // Map every chunk into the new range as well (a chunk may be
                // mapped twice), then unmap the old mappings: a failure
                // leaves the old range whole.
                let mut done = 0;
                let mut failure = None;
                for piece in &self.pieces {
                    let Backing::Cuda(chunk) = &piece.backing else { unreachable_backing() };
                    let r = new_range.map(piece.offset, chunk).and_then(|()| {
                        new_range.set_access(piece.offset, piece.size, &self.peers).inspect_err(|_| {
                            let _ = new_range.unmap(piece.offset, piece.size);
                        })
                    });
                    if let Err(e) = r {
                        failure = Some(e);
                        break;
                    }
                    done += 1;
                }
                if let Some(e) = failure {
                    for piece in &self.pieces[..done] {
                        let _ = new_range.unmap(piece.offset, piece.size);
                    }
                    return Err(e);
                }
                // The old mappings go once the work that may use them is
                // done (deferred while a capture forbids the wait).
                let old = self.remains_of(false);
                let waiter = if self.owner_settles { Waiter::None } else { self.waiter.clone() };
                old.settle_and_release(waiter);
            }
            Reservation::Host(new_range) => {
                for (i, piece) in self.pieces.iter().enumerate() {
                    let s = self.segment_of(piece.offset);
                    let seg_offset = piece.offset - self.segments[s].offset;
                    let Reservation::Host(old) = &mut self.segments[s].res else { unreachable_backing() };
                    // The fault point of the map the move stands for (never
                    // on the moves back below).
                    let moved = crate::fault::check(crate::fault::Point::Map)
                        .and_then(|()| old.move_to(seg_offset, piece.size, new_range, piece.offset));
                    if let Err(e) = moved {
                        // Move the pages already moved back where they were.
                        for back in &self.pieces[..i] {
                            let s = self.segment_of(back.offset);
                            let seg_offset = back.offset - self.segments[s].offset;
                            let Reservation::Host(old) = &mut self.segments[s].res else { unreachable_backing() };
                            if let Err(e2) = new_range.move_to(back.offset, back.size, old, seg_offset) {
                                eprintln!("cumem: moving {} B back after a failed remap: {e2}", back.size);
                            }
                        }
                        return Err(e);
                    }
                }
            }
        }
        self.base = fresh.addr();
        self.segments.clear();
        self.segments.push(Segment { offset: 0, res: fresh });
        Ok(())
    }
}
