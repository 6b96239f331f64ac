//! Where a pool's chunks come from.
//!
//! An [`Upstream`] hands out chunks: address ranges the pool carves into
//! blocks. The pool never reads or writes them (device memory can't be
//! touched from the host), so an upstream deals in addresses, not
//! references. [`Host`] is the fallback when no CUDA driver or device is
//! present; the CUDA ones ([`CudaDeviceMemory`], [`CudaPinnedMemory`],
//! [`CudaVmm`]) build on [`crate::cuda`].

mod cuda;
mod expandable;
mod geometric;
mod host;
mod host_vm;
pub(crate) mod region;
#[cfg(all(test, not(loom)))]
mod tests;

pub(crate) use cuda::{device_upstream, graph_upstream};
pub use cuda::{CudaDeviceMemory, CudaPinnedMemory};
pub use expandable::{CudaVmm, HostExpandable};
pub use geometric::Geometric;
pub use host::Host;
#[doc(hidden)]
pub use region::choose_pieces;
pub use region::{GrowPath, VmBackend};

use crate::error::Result;

/// Every chunk's and block's address and size are multiples of this
/// (CUDA's own allocation alignment, which code that uses the memory
/// relies on). Upstreams guarantee it for chunks; pools keep it for blocks.
pub const BLOCK_ALIGN: usize = 256;

/// The largest piece of new memory (one `cuMemCreate` handle, one
/// `cuMemMap`) a remapping pool maps; a piece is unmapped whole, so this is
/// how finely a large block's memory can move once it is free (rounded up
/// to the upstream's granularity).
pub const REMAP_PIECE: usize = 8 << 20;

/// The largest piece of new memory a remapping pool maps once it holds a
/// lot ([`remap_piece`]; measured in docs/replay.md, "Page moves").
pub const REMAP_PIECE_MAX: usize = 32 << 20;

/// The device's free memory per byte of the largest new piece mapped
/// under pressure (see [`remap_piece`]).
pub const FREE_PER_PIECE_BYTE: usize = 512;

/// The smallest piece of new memory under pressure (the device's large
/// page; rounded up to the upstream's granularity).
pub const PRESSED_PIECE: usize = 2 << 20;

/// The largest piece of new memory to map where `mapped` bytes are mapped
/// already and the device has `device_free` bytes free (`usize::MAX`:
/// unknown). Pieces grow with the memory held (a 32nd of it, a power of
/// two), from [`REMAP_PIECE`] to [`REMAP_PIECE_MAX`], so a pool growing
/// from nothing makes fewer, larger `cuMemCreate` calls, while a small
/// pool's memory still moves finely. Larger pieces move less finely once
/// free (a piece is unmapped whole).
///
/// Under pressure pieces shrink: never larger than a 512th of the
/// device's free memory ([`FREE_PER_PIECE_BYTE`], a power of two), down to
/// [`PRESSED_PIECE`]. Out of memory, only pieces wholly free can go back,
/// so what a piece partly in use holds free is lost to a large request;
/// small pieces near the device's limit keep that loss small, and the
/// largest program that fits is bound by its live bytes, not by the
/// layout. (The smallest simulated device a captured log of padded
/// generation fits on: 1.116 of its peak of live bytes with 32 MiB
/// pieces throughout, 1.012 with this rule; `cumem-replay --fit`.) A
/// device with 16 GiB or more free maps 32 MiB pieces as before.
pub fn remap_piece(mapped: usize, device_free: usize) -> usize {
    let grown = (mapped / 32).next_power_of_two().clamp(REMAP_PIECE, REMAP_PIECE_MAX);
    let share = device_free / FREE_PER_PIECE_BYTE;
    // The largest power of two at most `share` (at least the floor).
    let pressed = if share <= PRESSED_PIECE { PRESSED_PIECE } else { 1 << share.ilog2() };
    grown.min(pressed)
}

/// What queued work may still use memory a page move lends
/// ([`Upstream::lend_within`]).
#[derive(Clone)]
pub enum Queued {
    /// None: its blocks' stream work is known complete.
    Nothing,
    /// Work on any stream of the device or its peers: the upstream waits
    /// for the device (and its peers) before it lends, or lends nothing
    /// when it can't wait now (a capture under way).
    Any,
    /// Only work queued before the fence on the stream the memory is lent
    /// for: the new owner's work on that stream runs after it, so the
    /// memory is lent with no wait, and its old mapping stays until the
    /// fence has passed (a map that needs those addresses waits for it).
    Before(std::sync::Arc<dyn crate::tag::Fence>),
}

impl Queued {
    /// Whether an upstream that unmaps, not lends, must wait for the device.
    pub fn waits(&self) -> bool {
        !matches!(self, Queued::Nothing)
    }
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Queued::Nothing => "Nothing",
            Queued::Any => "Any",
            Queued::Before(_) => "Before(fence)",
        })
    }
}

/// An address range an upstream handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Chunk {
    /// The first address.
    pub addr: usize,
    /// The length in bytes.
    pub size: usize,
}

impl Chunk {
    /// One past the last address.
    pub fn end(&self) -> usize {
        self.addr + self.size
    }
}

/// A source of chunks for a pool.
///
/// Called outside the pool's lock, from several threads at once.
///
/// # Wrappers
/// An upstream that wraps another (to count, book or route its chunks)
/// returns it from [`inner`](Upstream::inner) and overrides only what it
/// changes: every provided method forwards to the inner upstream when
/// there is one, and gives the leaf answer ("can't") when there is none.
/// A method added to this trait later is therefore forwarded by every
/// wrapper at once; none can drop it by forgetting to re-list it.
///
/// # Examples
/// ```
/// use cumem::upstream::{Host, Upstream};
/// let host = Host::new();
/// let c = host.allocate_chunk(1 << 20)?;
/// assert!(c.addr % 256 == 0 && c.size >= 1 << 20);
/// host.deallocate_chunk(c)?;
/// # Ok::<(), cumem::Error>(())
/// ```
pub trait Upstream: Send + Sync + 'static {
    /// Allocates a chunk of at least `size` bytes whose address is aligned
    /// to at least 256 bytes. `size` is a multiple of [`granularity`].
    ///
    /// # Errors
    /// [`Error::OutOfMemory`](crate::error::Error::OutOfMemory) or a driver/OS error
    /// when the memory can't be had.
    ///
    /// [`granularity`]: Upstream::granularity
    fn allocate_chunk(&self, size: usize) -> Result<Chunk>;

    /// Returns a chunk this upstream allocated, none of its blocks in use.
    ///
    /// # Errors
    /// A driver or OS error; the chunk is then leaked, never reused.
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()>;

    /// The upstream this one wraps, which the provided methods forward to;
    /// `None` (the default) for an upstream that owns its memory itself.
    fn inner(&self) -> Option<&dyn Upstream> {
        None
    }

    /// Tries to grow `chunk` in place by `extra` bytes (a multiple of
    /// [`granularity`](Upstream::granularity)), so the new memory continues
    /// the old range. Returns `Ok(false)` when this upstream can't.
    ///
    /// # Errors
    /// A driver or OS error while growing.
    fn try_extend(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        self.inner().map_or(Ok(false), |u| u.try_extend(chunk, extra))
    }

    /// Whether [`try_extend`](Upstream::try_extend) can ever succeed.
    fn can_extend(&self) -> bool {
        self.inner().is_some_and(|u| u.can_extend())
    }

    /// Gives back the last `amount` bytes of `chunk`, which was grown with
    /// [`try_extend`](Upstream::try_extend). Returns `Ok(false)` when this
    /// upstream can't shrink chunks.
    ///
    /// # Errors
    /// A driver or OS error while shrinking.
    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        self.inner().map_or(Ok(false), |u| u.try_shrink(chunk, amount))
    }

    /// The unit chunk sizes are rounded to (a power of two, at least 256).
    fn granularity(&self) -> usize {
        self.inner().map_or(BLOCK_ALIGN, |u| u.granularity())
    }

    /// A short name for summaries ("host", "cuMemAlloc", ...).
    fn name(&self) -> &'static str {
        self.inner().map_or("upstream", |u| u.name())
    }

    /// Whether the host may read and write the memory (default `false`).
    fn host_accessible(&self) -> bool {
        self.inner().is_some_and(|u| u.host_accessible())
    }

    /// The device's free memory, where the upstream can ask (error messages).
    fn device_free(&self) -> Option<usize> {
        self.inner().and_then(|u| u.device_free())
    }

    /// Whether this upstream can hand out chunks as address space alone
    /// ([`reserve_chunk`](Upstream::reserve_chunk)) and map and unmap
    /// memory page by page inside them ([`map_runs`](Upstream::map_runs),
    /// [`unmap_within`](Upstream::unmap_within)): page remapping, with
    /// pages of [`granularity`](Upstream::granularity) bytes.
    fn can_remap(&self) -> bool {
        self.inner().is_some_and(|u| u.can_remap())
    }

    /// Reserves a chunk of `size` bytes (a multiple of the granularity) of
    /// address space with no memory mapped in it.
    ///
    /// # Errors
    /// [`Error::InvalidState`](crate::error::Error::InvalidState) when the
    /// upstream can't remap; out of address space.
    fn reserve_chunk(&self, size: usize) -> Result<Chunk> {
        if let Some(u) = self.inner() {
            return u.reserve_chunk(size);
        }
        Err(crate::error::Error::InvalidState(format!("{} can't reserve address space alone", self.name())))
    }

    /// Extends `chunk`'s address space in place by `extra` bytes, mapping
    /// nothing. `Ok(false)` when it can't.
    ///
    /// # Errors
    /// An upstream error.
    fn try_extend_reserved(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        self.inner().map_or(Ok(false), |u| u.try_extend_reserved(chunk, extra))
    }

    /// Maps memory over each run (page-aligned, unmapped, inside chunks of
    /// this upstream), reusing memory [`unmap_within`](Upstream::unmap_within)
    /// kept, and gives the device (and its peers) access. Returns the
    /// number of map calls made. On failure no run stays mapped.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`](crate::error::Error::OutOfMemory) or a driver error.
    fn map_runs(&self, runs: &[Chunk]) -> Result<u64> {
        if let Some(u) = self.inner() {
            return u.map_runs(runs);
        }
        Err(crate::error::Error::InvalidState(format!("{} can't map pages", self.name())))
    }

    /// Unmaps whole mapped pieces lying inside `spans` (in the order
    /// given) until at least `want` bytes are unmapped, and returns them.
    /// With `pending`, work queued on streams may still use the spans:
    /// the upstream waits for it first, or unmaps nothing when it can't
    /// wait now. The memory is kept for the next
    /// [`map_runs`](Upstream::map_runs) (`keep`) or released.
    ///
    /// # Errors
    /// A driver error.
    fn unmap_within(&self, spans: &[Chunk], want: usize, pending: bool, keep: bool) -> Result<Vec<Chunk>> {
        self.inner().map_or(Ok(Vec::new()), |u| u.unmap_within(spans, want, pending, keep))
    }

    /// [`unmap_within`](Upstream::unmap_within) keeping the memory, but
    /// the upstream may leave it mapped where it was until
    /// [`unmap_stale`](Upstream::unmap_stale) (or a map that needs those
    /// addresses) unmaps it: the next map maps it at its new addresses
    /// meanwhile, and the thread that moves memory makes no unmap call.
    /// `queued` says what work may still use the spans ([`Queued`]): no
    /// work reaches the new owner's memory through the old addresses
    /// unless it is ordered before the new owner's. By default it unmaps
    /// at once (waiting for the device first unless `queued` is
    /// [`Queued::Nothing`]).
    ///
    /// # Errors
    /// A driver error.
    fn lend_within(&self, spans: &[Chunk], want: usize, queued: Queued) -> Result<Vec<Chunk>> {
        match self.inner() {
            Some(u) => u.lend_within(spans, want, queued),
            None => self.unmap_within(spans, want, queued.waits(), true),
        }
    }

    /// Unmaps at most `most` of the old mappings [`lend_within`](Upstream::lend_within)
    /// left (their memory is mapped elsewhere or kept); returns how many.
    /// A mapping lent before a fence ([`Queued::Before`]) that has not
    /// passed is waited for with `wait`, and passed over without.
    fn unmap_stale(&self, most: usize, wait: bool) -> usize {
        self.inner().map_or(0, |u| u.unmap_stale(most, wait))
    }

    /// Whether [`unmap_stale`](Upstream::unmap_stale) has work.
    fn has_stale(&self) -> bool {
        self.inner().is_some_and(|u| u.has_stale())
    }

    /// Releases memory an [`unmap_within`](Upstream::unmap_within) kept
    /// and no [`map_runs`](Upstream::map_runs) reused.
    fn release_kept(&self) {
        if let Some(u) = self.inner() {
            u.release_kept()
        }
    }

    /// The bytes of memory [`unmap_within`](Upstream::unmap_within) kept
    /// and no [`map_runs`](Upstream::map_runs) has reused yet: physical
    /// memory held with no address (a remapping pool counts it as held).
    /// A successful `map_runs` keeps what it did not reuse, for later maps.
    fn kept(&self) -> usize {
        self.inner().map_or(0, |u| u.kept())
    }

    /// Releases kept memory, largest pieces first, until at most `keep`
    /// bytes remain kept (all of it by default).
    fn trim_kept(&self, keep: usize) {
        match self.inner() {
            Some(u) => u.trim_kept(keep),
            None if self.kept() > keep => self.release_kept(),
            None => {}
        }
    }

    /// The pieces of memory mapped over `[addr, addr + size)`, each whole
    /// as it was mapped, in address order and with no gap between them,
    /// for an upstream that maps memory piece by piece (CUDA VMM: what
    /// sharing the span with another process exports). `None` for an
    /// upstream whose chunks are whole allocations, or a span not wholly
    /// mapped.
    fn mapped_pieces(&self, addr: usize, size: usize) -> Option<Vec<Chunk>> {
        self.inner().and_then(|u| u.mapped_pieces(addr, size))
    }
}

/// A boxed upstream is the upstream itself: everything forwards.
impl Upstream for Box<dyn Upstream> {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        (**self).allocate_chunk(size)
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        (**self).deallocate_chunk(chunk)
    }
    fn inner(&self) -> Option<&dyn Upstream> {
        Some(&**self)
    }
}
