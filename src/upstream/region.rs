//! A virtual region: reserved address space with memory mapped into it, on
//! the GPU (CUDA VMM) or on the host fallback (mmap), behind one API.
//!
//! # Implementation details
//! ```text
//!  base                                                     base + reserved
//!  |<----- segment 0 ----->|<-- segment 1 -->|<---- segment 2 ---->|
//!  [piece][piece   ][piece ][piece          ][piece]  (unmapped)
//!  |<------------------- mapped pieces ------------->|
//! ```
//! Invariants:
//! - segments are reservations that together cover `[0, reserved)` with no
//!   gap (later ones come from growing in place, with a hint);
//! - pieces are sorted by offset, do not overlap, and each lies inside one
//!   segment (a mapping may not span two reservations);
//! - a piece is unmapped exactly as it was mapped, whole.
//!
//! With headroom on (growable buffers), a guard reservation holds the
//! addresses right after the last segment, so nobody else takes them; it is
//! given back just before the reservation is extended into it.
//!
//! Growing the reservation first asks for the addresses right after it. If
//! the driver (or kernel) gives another address, that range is freed and a
//! new, larger range is reserved; the same pieces are mapped into it (on the
//! GPU, the physical chunks; on the host, the pages move with `mremap`) and
//! the old range is freed. No data is copied on either path.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::host_vm::{page_size, HostRange};
use crate::cuda::vmm::{self, AddressRange, PhysicalChunk};
use crate::cuda::{
    device_context, driver_status, follow_active_peers, initial_peers, register_mapped, DriverStatus, PeerMapped,
};
use crate::error::{Error, Result};
use crate::sync::{lock, Mutex};

mod grow;
mod pages;
mod settle;
mod stale;

pub use pages::choose_pieces;
pub(crate) use pages::{Planned, Released};
pub(crate) use settle::{deferred_and_leaked, release_deferred, Settled, Waiter};
pub(crate) use stale::StaleUnmap;
use stale::{Lending, Stale};

/// Where a virtual region's memory lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmBackend {
    /// Device memory of the CUDA device with this ordinal (CUDA VMM).
    Cuda(usize),
    /// The host fallback: `mmap`-reserved address space committed with
    /// `mprotect`.
    Host,
}

impl VmBackend {
    /// The default device (see [`Stream::new`](crate::Stream::new)) when
    /// the CUDA driver is usable, the host fallback when it is not (or
    /// `CUMEM_FORCE_HOST=1` is set).
    pub fn auto() -> Self {
        match driver_status() {
            DriverStatus::Available { .. } => VmBackend::Cuda(crate::cuda::default_ordinal()),
            DriverStatus::Unavailable(_) => VmBackend::Host,
        }
    }

    /// The device of `stream` (a host queue: [`auto`](Self::auto)).
    pub fn of_stream(stream: &crate::cuda::Stream) -> Self {
        stream.device().map_or_else(VmBackend::auto, VmBackend::Cuda)
    }

    /// Whether this is the host fallback.
    pub fn is_host(&self) -> bool {
        matches!(self, VmBackend::Host)
    }
}

impl std::fmt::Display for VmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmBackend::Cuda(ordinal) => write!(f, "CUDA device {ordinal} (virtual memory management)"),
            VmBackend::Host => f.write_str("host fallback (mmap)"),
        }
    }
}

/// How a growth was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrowPath {
    /// There was enough capacity already; nothing changed.
    Unchanged,
    /// New memory was mapped inside the address range already reserved.
    WithinReservation,
    /// The reservation was extended right after its end (a hint); the base
    /// address did not change.
    InPlace,
    /// A larger range was reserved elsewhere and the same memory remapped
    /// into it; the base address changed, no data was copied.
    Remapped,
}

#[derive(Debug)]
enum Space {
    Cuda { ctx: Arc<CudaContext>, granularity: usize },
    Host { page: usize },
}

#[derive(Debug)]
enum Reservation {
    Cuda(AddressRange),
    Host(HostRange),
}

impl Reservation {
    fn new(space: &Space, size: usize, hint: usize) -> Result<Self> {
        match space {
            Space::Cuda { ctx, .. } => Ok(Reservation::Cuda(AddressRange::reserve(ctx, size, hint as u64)?)),
            Space::Host { .. } => Ok(Reservation::Host(HostRange::reserve(size, hint)?)),
        }
    }

    fn addr(&self) -> usize {
        match self {
            Reservation::Cuda(r) => r.ptr() as usize,
            Reservation::Host(r) => r.addr(),
        }
    }

    fn size(&self) -> usize {
        match self {
            Reservation::Cuda(r) => r.size(),
            Reservation::Host(r) => r.size(),
        }
    }
}

#[derive(Debug)]
enum Backing {
    Cuda(PhysicalChunk),
    Host,
}

impl Backing {
    /// The device memory's handle (`None`: host memory).
    fn handle(&self) -> Option<u64> {
        match self {
            Backing::Cuda(p) => Some(p.handle()),
            Backing::Host => None,
        }
    }
}

#[derive(Debug)]
struct Piece {
    offset: usize,
    size: usize,
    backing: Backing,
}

#[derive(Debug)]
struct Segment {
    offset: usize,
    res: Reservation,
}

/// Reserved address space with pieces of memory mapped into it.
#[derive(Debug)]
pub(crate) struct Region {
    space: Space,
    base: usize,
    segments: Vec<Segment>,
    pieces: Vec<Piece>,
    peers: Vec<usize>,
    /// Whether to keep a guard after the reservation.
    headroom: bool,
    /// Address space reserved right after the last segment (no memory), so
    /// that nobody else takes the addresses growth in place needs. Given
    /// back just before the reservation is extended into it.
    guard: Option<Reservation>,
    /// The owner waits for the work that used a piece before it gives the
    /// piece back (graph-private pools): no device-wide wait here.
    owner_settles: bool,
    /// Memory unmapped by page remapping and kept for the next map
    /// (`pages.rs`): `(size, backing)`. The pool counts it as held.
    spare: Vec<(usize, Backing)>,
    /// Runs being mapped with the lock dropped (`pages.rs`): `(offset,
    /// size)`, kept off other maps until they are recorded.
    in_flight: Vec<(usize, usize)>,
    /// Old mappings of memory lent to a map elsewhere and still mapped
    /// here (`stale.rs`, [`lend_within`](Self::lend_within)), each
    /// once a piece. Maps keep off them; they are unmapped behind the
    /// allocating thread ([`plan_stale_unmap`](Self::plan_stale_unmap)),
    /// or first by a map that needs their addresses, or when the region
    /// gives its memory back. A mapping lent before a fence is unmapped
    /// only once the fence has passed (waited for by those that can't
    /// pass it over).
    stale: Vec<Stale>,
    /// Stale mappings being unmapped with the lock dropped.
    stale_busy: Vec<(usize, usize)>,
    /// The fences of the move under way: memory lent behind them is
    /// mapped by that move's map, whose stream waits for them; any other
    /// map waits for its fence first (`stale.rs`).
    lending: Lending,
    /// How shrinking, remapping and dropping wait for the work that may
    /// use the memory (`settle.rs`).
    waiter: Waiter,
}

/// The guard after a reservation is this many times its size (at least
/// 1 GiB): address space only.
const HEADROOM_FACTOR: usize = 8;

fn round_up(x: usize, to: usize) -> Option<usize> {
    x.checked_next_multiple_of(to)
}

impl Region {
    /// Reserves at least `size` bytes on `backend`. With `headroom`, the
    /// addresses after the range are cleared first (a larger range is
    /// reserved and given back, and the new one placed at its start), so
    /// that later growth can extend in place. Private: regions are made
    /// with [`reserve_shared`](Self::reserve_shared), which registers them
    /// for peer access.
    fn reserve(backend: &VmBackend, size: usize, headroom: bool) -> Result<Self> {
        let (space, peers) = match backend {
            VmBackend::Host => (Space::Host { page: page_size() }, Vec::new()),
            VmBackend::Cuda(ordinal) => {
                let ctx = device_context(*ordinal)?.ok_or(Error::NeedsGpu("a CUDA VMM region"))?;
                let granularity = vmm::granularity(&ctx)?.minimum;
                // Every reachable peer under CUMEM_MAP_PEERS=all; the
                // table's grants and followed peers come at registration
                // (`cuda/peer.rs`).
                (Space::Cuda { ctx, granularity }, initial_peers(*ordinal))
            }
        };
        let mut region = Region {
            space,
            base: 0,
            segments: Vec::new(),
            pieces: Vec::new(),
            peers,
            owner_settles: false,
            headroom,
            guard: None,
            spare: Vec::new(),
            in_flight: Vec::new(),
            stale: Vec::new(),
            stale_busy: Vec::new(),
            lending: Lending::default(),
            waiter: Waiter::None,
        };
        if let Space::Cuda { ctx, .. } = &region.space {
            region.waiter = Waiter::Device(ctx.clone());
        }
        let size = region.round(size.max(1))?;
        let res = region.fresh_reservation(size)?;
        region.base = res.addr();
        region.segments.push(Segment { offset: 0, res });
        region.place_guard();
        Ok(region)
    }

    fn guard_size(&self, reserved: usize) -> Option<usize> {
        reserved.checked_mul(HEADROOM_FACTOR).and_then(|g| round_up(g.max(1 << 30), self.granularity()))
    }

    /// A new reservation of `size` bytes. With headroom, a range large
    /// enough for it and its guard is reserved and given back first, and
    /// the new range placed at its start, so the addresses after it are
    /// free for the guard.
    fn fresh_reservation(&self, size: usize) -> Result<Reservation> {
        if self.headroom {
            let probe = self.guard_size(size).and_then(|g| g.checked_add(size));
            if let Some(Ok(big)) = probe.map(|p| Reservation::new(&self.space, p, 0)) {
                let at = big.addr();
                drop(big);
                if let Ok(res) = Reservation::new(&self.space, size, at) {
                    return Ok(res);
                }
            }
        }
        Reservation::new(&self.space, size, 0)
    }

    /// Reserves the guard right after the reservation, if headroom is on and
    /// those addresses are free (else there is no guard).
    fn place_guard(&mut self) {
        self.guard = None;
        if !self.headroom {
            return;
        }
        let end = self.base + self.reserved();
        if let Some(Ok(guard)) = self.guard_size(self.reserved()).map(|g| Reservation::new(&self.space, g, end)) {
            if guard.addr() == end {
                self.guard = Some(guard);
            }
        }
    }

    /// Turns the guard after the reservation on or off (see
    /// `GrowableBuffer::set_headroom`).
    pub(crate) fn set_headroom(&mut self, on: bool) {
        self.headroom = on;
        if on && self.guard.is_some() {
            return;
        }
        self.place_guard();
    }

    /// The bytes of address space the guard holds (0 without one).
    pub(crate) fn headroom(&self) -> usize {
        self.guard.as_ref().map_or(0, Reservation::size)
    }

    /// The unit of reservation and mapping: the device's minimum VMM
    /// granularity, or the host page size.
    pub(crate) fn granularity(&self) -> usize {
        match &self.space {
            Space::Cuda { granularity, .. } => *granularity,
            Space::Host { page } => *page,
        }
    }

    /// Rounds `size` up to the granularity.
    pub(crate) fn round(&self, size: usize) -> Result<usize> {
        round_up(size, self.granularity())
            .filter(|s| *s <= isize::MAX as usize)
            .ok_or(Error::InvalidSize { size, reason: "larger than the address space" })
    }

    /// The context, on the CUDA backend.
    pub(crate) fn cuda_context(&self) -> Option<&Arc<CudaContext>> {
        match &self.space {
            Space::Cuda { ctx, .. } => Some(ctx),
            Space::Host { .. } => None,
        }
    }

    /// The backend.
    pub(crate) fn backend(&self) -> VmBackend {
        match &self.space {
            Space::Cuda { ctx, .. } => VmBackend::Cuda(ctx.ordinal()),
            Space::Host { .. } => VmBackend::Host,
        }
    }

    /// The first address of the region.
    pub(crate) fn base(&self) -> usize {
        self.base
    }

    /// The bytes of address space reserved.
    pub(crate) fn reserved(&self) -> usize {
        self.segments.last().map_or(0, |s| s.offset + s.res.size())
    }

    /// The end (offset) of the mapped memory that starts at offset 0 with
    /// no gap.
    pub(crate) fn mapped_prefix(&self) -> usize {
        let mut end = 0;
        for p in &self.pieces {
            if p.offset != end {
                break;
            }
            end += p.size;
        }
        end
    }

    /// The end (offset) of the highest mapped piece.
    pub(crate) fn mapped_end(&self) -> usize {
        self.pieces.last().map_or(0, |p| p.offset + p.size)
    }

    fn segment_of(&self, offset: usize) -> usize {
        self.segments.partition_point(|s| s.offset + s.res.size() <= offset)
    }

    /// Maps new memory over `[offset, offset + size)` (multiples of the
    /// granularity, currently unmapped, inside the reservation): one piece
    /// per segment it crosses. On failure nothing new stays mapped.
    pub(crate) fn map(&mut self, offset: usize, size: usize) -> Result<()> {
        let end = offset.checked_add(size).filter(|e| *e <= self.reserved() && size > 0);
        let gran = self.granularity();
        let Some(end) = end.filter(|_| offset % gran == 0 && size % gran == 0) else {
            return Err(Error::InvalidState(format!(
                "can't map {size} B at offset {offset}: the region reserves {} B in units of {gran} B",
                self.reserved()
            )));
        };
        let at = self.pieces.partition_point(|p| p.offset < offset);
        let overlaps_prev = at > 0 && self.pieces[at - 1].offset + self.pieces[at - 1].size > offset;
        let overlaps_next = self.pieces.get(at).is_some_and(|p| p.offset < end);
        if overlaps_prev || overlaps_next {
            return Err(Error::InvalidState(format!("offset {offset} (+{size} B) is already mapped")));
        }
        let mut new = Vec::new();
        let mut cursor = offset;
        while cursor < end {
            let seg = &self.segments[self.segment_of(cursor)];
            let part = (seg.offset + seg.res.size()).min(end) - cursor;
            match self.map_piece(seg, cursor - seg.offset, part) {
                Ok(backing) => new.push(Piece { offset: cursor, size: part, backing }),
                Err(e) => {
                    for piece in new {
                        self.unmap_piece(&piece);
                    }
                    return Err(e);
                }
            }
            cursor += part;
        }
        self.pieces.splice(at..at, new);
        Ok(())
    }

    fn map_piece(&self, seg: &Segment, seg_offset: usize, size: usize) -> Result<Backing> {
        match &seg.res {
            Reservation::Cuda(range) => {
                let chunk = PhysicalChunk::create(range.context(), size)?;
                range.map(seg_offset, &chunk)?;
                if let Err(e) = range.set_access(seg_offset, size, &self.peers) {
                    let _ = range.unmap(seg_offset, size);
                    return Err(e);
                }
                Ok(Backing::Cuda(chunk))
            }
            Reservation::Host(range) => {
                range.commit(seg_offset, size)?;
                Ok(Backing::Host)
            }
        }
    }

    /// Unmaps one piece (errors are logged: the piece is gone either way).
    fn unmap_piece(&self, piece: &Piece) {
        let seg = &self.segments[self.segment_of(piece.offset)];
        let result = match &seg.res {
            Reservation::Cuda(range) => range.unmap(piece.offset - seg.offset, piece.size),
            Reservation::Host(range) => range.decommit(piece.offset - seg.offset, piece.size),
        };
        if let Err(e) = result {
            eprintln!("cumem: unmapping {} B at offset {}: {e}", piece.size, piece.offset);
        }
    }

    fn synchronize(&self) -> Result<()> {
        if self.owner_settles {
            return Ok(());
        }
        match &self.space {
            Space::Cuda { ctx, .. } => vmm::synchronize(ctx),
            Space::Host { .. } => Ok(()),
        }
    }

    /// Unmaps and releases the pieces that make up `[offset, offset + size)`
    /// at once: the caller waited first ([`settle`](Self::settle) answered
    /// [`Settled::Now`]). Returns `Ok(false)`, changing nothing,
    /// unless whole pieces cover the span exactly (none is cut in two and
    /// there is no gap).
    pub(crate) fn unmap(&mut self, offset: usize, size: usize) -> Result<bool> {
        let end = offset.saturating_add(size);
        let first = self.pieces.partition_point(|p| p.offset < offset);
        let last = self.pieces.partition_point(|p| p.offset < end);
        let cut_before = first > 0 && self.pieces[first - 1].offset + self.pieces[first - 1].size > offset;
        let cut_after = last > first && self.pieces[last - 1].offset + self.pieces[last - 1].size > end;
        let covered: usize = self.pieces[first..last].iter().map(|p| p.size).sum();
        if cut_before || cut_after || covered != size || size == 0 {
            return Ok(false);
        }
        // Old mappings there go too (a failed wait for one changes nothing).
        self.unmap_stale_in(offset, end)?;
        let removed: Vec<Piece> = self.pieces.drain(first..last).collect();
        for piece in &removed {
            self.unmap_piece(piece);
        }
        Ok(true)
    }

    /// The offsets where pieces start, for callers that shrink to a piece
    /// boundary.
    pub(crate) fn piece_bounds(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.pieces.iter().map(|p| (p.offset, p.size))
    }

    /// Gives access to the mapped memory to the devices in `peers` too
    /// (added to those that have it already), now and for every piece
    /// mapped later (`cuMemSetAccess`). Nothing to do on the host.
    pub(crate) fn set_peers(&mut self, peers: &[usize]) -> Result<()> {
        if peers.iter().all(|p| self.peers.contains(p)) {
            // Named by every mapping already (as every reachable peer is).
            return Ok(());
        }
        let mut all = self.peers.clone();
        for &p in peers {
            if !all.contains(&p) {
                all.push(p);
            }
        }
        for piece in &self.pieces {
            let seg = &self.segments[self.segment_of(piece.offset)];
            if let Reservation::Cuda(range) = &seg.res {
                range.set_access(piece.offset - seg.offset, piece.size, &all)?;
            }
        }
        self.peers = all;
        Ok(())
    }

    /// From now on the owner waits for the work that used a piece before
    /// giving it back, and unmapping waits for no device.
    pub(crate) fn set_owner_settles(&mut self) {
        self.owner_settles = true;
    }

    /// The devices given access besides the owner.
    pub(crate) fn peers(&self) -> &[usize] {
        &self.peers
    }

    /// [`reserve`](Self::reserve), shared behind a lock and, on CUDA,
    /// registered for peer access: every device granted access to this
    /// device's memory (`enable_peer_access`), before or after, reaches all
    /// the region's mappings.
    pub(crate) fn reserve_shared(backend: &VmBackend, size: usize, headroom: bool) -> Result<SharedRegion> {
        if let VmBackend::Cuda(_) = backend {
            follow_active_peers()?;
        }
        let region = Arc::new(Mutex::new(Region::reserve(backend, size, headroom)?));
        if let VmBackend::Cuda(ordinal) = backend {
            register_mapped(*ordinal, &region)?;
        }
        Ok(region)
    }
}

/// A region behind its lock, as growable buffers and expandable segments
/// hold it (registered for peer access on CUDA).
pub(crate) type SharedRegion = Arc<Mutex<Region>>;

impl PeerMapped for Mutex<Region> {
    fn set_peers(&self, peers: &[usize]) -> Result<()> {
        lock(self).set_peers(peers)
    }
}

/// Pieces always match their segments' backend.
fn unreachable_backing() -> ! {
    unreachable!("a region mixes CUDA and host memory")
}

impl Drop for Region {
    /// Waits ([`settle`](Region::settle)), then unmaps every piece, releases
    /// the memory and frees the addresses; deferred while a capture forbids
    /// the wait; leaked (logged) when a wait or an unmap fails, so nothing
    /// is released twice or while still mapped.
    fn drop(&mut self) {
        let _relaxed = crate::cuda::RelaxedCaptureMode::enter();
        let remains = self.remains_of(true);
        let waiter = if self.owner_settles { Waiter::None } else { self.waiter.clone() };
        remains.settle_and_release(waiter);
    }
}
