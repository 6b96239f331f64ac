//! Expandable segments: upstreams that reserve one large address range per
//! pool and map memory into it on demand, so a chunk can grow in place and
//! new memory continues the pool's tail (PyTorch's `expandable_segments`).
//!
//! [`CudaVmm`] maps physical device memory (`cuMemCreate` + `cuMemMap`);
//! [`HostExpandable`] is the same over host address space, for machines
//! without a GPU. Both keep the list of mapped pieces (offset, physical
//! memory) so shrinking and freeing unmap exactly what was mapped.
//! Page remapping (mapping runs, unmapping and lending free pages, the
//! memory kept between them) is in `expandable/remap.rs`.

use super::region::{Region, SharedRegion, VmBackend};
use super::{Chunk, Queued, Upstream};
use crate::cuda::{captures_under_way, device_context, driver_err, follow_active_peers, vmm, RelaxedCaptureMode};
use crate::error::{Error, OomState, PoolKind, Result};
use crate::sync::{lock, Mutex};

mod remap;

/// The state both expandable upstreams share: one reserved region.
#[derive(Debug)]
struct Expandable {
    region: SharedRegion,
    base: usize,
    reserved: usize,
    granularity: usize,
    /// The end (offset) of the address space handed out as chunks with
    /// nothing mapped ([`Upstream::reserve_chunk`]; page remapping).
    reserved_top: Mutex<usize>,
    /// Whether the region maps device memory (peers are followed before
    /// each map: `cuda/peer.rs`).
    cuda: bool,
    /// The last reading of the device's free memory (`remap.rs`).
    free_seen: Mutex<FreeSeen>,
}

/// A reading of the device's free memory, which sizes new pieces
/// ([`remap_piece`](crate::upstream::remap_piece)): when it was taken, what
/// it said, and the new memory mapped since.
#[derive(Debug, Default)]
struct FreeSeen {
    at: Option<std::time::Instant>,
    free: usize,
    made: usize,
}

impl Expandable {
    fn new(backend: &VmBackend, reserve: usize) -> Result<Self> {
        let region = Region::reserve_shared(backend, reserve, false)?;
        let (base, reserved, granularity) = {
            let r = lock(&region);
            (r.base(), r.reserved(), r.granularity())
        };
        let cuda = matches!(backend, VmBackend::Cuda(_));
        let free_seen = Mutex::new(FreeSeen::default());
        Ok(Expandable { base, reserved, granularity, region, reserved_top: Mutex::new(0), cuda, free_seen })
    }

    /// Gives peers that became active access before a map, with no lock of
    /// the region held yet (`cuda/peer.rs`).
    fn follow_peers(&self) -> Result<()> {
        if self.cuda {
            follow_active_peers()?;
        }
        Ok(())
    }

    /// The offset of `chunk` in the region, if it lies inside it.
    fn offset_of(&self, chunk: Chunk) -> Option<usize> {
        let offset = chunk.addr.checked_sub(self.base)?;
        (offset.checked_add(chunk.size)? <= self.reserved).then_some(offset)
    }

    fn oom(&self, size: usize, why: String, kind: PoolKind) -> Error {
        Error::OutOfMemory {
            pool: kind,
            requested: size,
            state: Box::new(OomState { upstream: Some(why), ..Default::default() }),
        }
    }

    /// Maps `size` bytes at `offset`, turning the driver's out-of-memory
    /// error into [`Error::OutOfMemory`] so the pool releases cached chunks
    /// and retries.
    fn map(&self, region: &mut Region, offset: usize, size: usize, kind: PoolKind) -> Result<()> {
        region.map(offset, size).map_err(|e| {
            if vmm::is_out_of_memory(&e) {
                self.oom(size, e.to_string(), kind)
            } else {
                e
            }
        })
    }

    fn allocate_chunk(&self, size: usize, kind: PoolKind) -> Result<Chunk> {
        if size == 0 {
            return Err(Error::InvalidSize { size, reason: "a chunk can't be empty" });
        }
        let size = size
            .checked_next_multiple_of(self.granularity)
            .ok_or(Error::InvalidSize { size, reason: "larger than the address space" })?;
        self.follow_peers()?;
        let mut region = lock(&self.region);
        // Prefer the end of the mapped memory; else the first hole that fits.
        let mut offset = region.mapped_end();
        if offset.checked_add(size).is_none_or(|end| end > self.reserved) {
            let mut cursor = 0;
            let mut found = None;
            for (start, len) in region.piece_bounds() {
                if start - cursor >= size {
                    found = Some(cursor);
                    break;
                }
                cursor = start + len;
            }
            offset = found.ok_or_else(|| {
                let why = format!("the expandable segment's {} B reservation has no room for {size} B", self.reserved);
                self.oom(size, why, kind)
            })?;
        }
        self.map(&mut region, offset, size, kind)?;
        Ok(Chunk { addr: self.base + offset, size })
    }

    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        let unknown =
            || Error::InvalidState(format!("chunk {:#x}+{} is not mapped by this upstream", chunk.addr, chunk.size));
        let offset = self.offset_of(chunk).ok_or_else(unknown)?;
        // A chunk of page remapping may hold holes: unmap what is mapped.
        // Nothing mapped is fine only for address space handed out alone.
        let mut region = lock(&self.region);
        let mut top = lock(&self.reserved_top);
        let mapped = region.unmap_inside(offset, chunk.size)?.ok_or_else(unknown)?;
        if mapped == 0 && offset + chunk.size > *top {
            return Err(unknown());
        }
        if *top == offset + chunk.size {
            *top = offset;
        }
        Ok(())
    }

    fn try_extend(&self, chunk: Chunk, extra: usize, kind: PoolKind) -> Result<bool> {
        let Some(offset) = self.offset_of(chunk) else { return Ok(false) };
        if extra == 0 || extra % self.granularity != 0 {
            return Ok(false);
        }
        let Some(end) = (offset + chunk.size).checked_add(extra).filter(|e| *e <= self.reserved) else {
            return Ok(false);
        };
        self.follow_peers()?;
        let mut region = lock(&self.region);
        // The addresses after the chunk must be unmapped.
        let taken = region.piece_bounds().any(|(start, len)| start < end && start + len > offset + chunk.size);
        if taken {
            return Ok(false);
        }
        self.map(&mut region, offset + chunk.size, extra, kind)?;
        Ok(true)
    }

    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        let Some(offset) = self.offset_of(chunk) else { return Ok(false) };
        if amount == 0 || amount >= chunk.size {
            return Ok(false);
        }
        let end = offset + chunk.size;
        if lock(&self.region).unmap_inside(end - amount, amount)?.is_none() {
            return Ok(false);
        }
        let mut top = lock(&self.reserved_top);
        if *top == end {
            *top = end - amount;
        }
        Ok(true)
    }

    /// Address space for a chunk, above everything mapped or handed out.
    fn reserve_chunk(&self, size: usize, kind: PoolKind) -> Result<Chunk> {
        if size == 0 || size % self.granularity != 0 {
            return Err(Error::InvalidSize { size, reason: "not a positive multiple of the granularity" });
        }
        let mapped_end = lock(&self.region).mapped_end();
        let mut top = lock(&self.reserved_top);
        let offset = (*top).max(mapped_end);
        if offset.checked_add(size).is_none_or(|end| end > self.reserved) {
            let why = format!("the expandable segment's {} B reservation has no room for {size} B", self.reserved);
            return Err(self.oom(size, why, kind));
        }
        *top = offset + size;
        Ok(Chunk { addr: self.base + offset, size })
    }

    fn try_extend_reserved(&self, chunk: Chunk, extra: usize) -> bool {
        let Some(offset) = self.offset_of(chunk) else { return false };
        let mut top = lock(&self.reserved_top);
        let end = offset + chunk.size;
        if extra == 0 || extra % self.granularity != 0 || *top != end || end + extra > self.reserved {
            return false;
        }
        *top = end + extra;
        true
    }

    fn mapped(&self) -> usize {
        lock(&self.region).piece_bounds().map(|(_, len)| len).sum()
    }
}

/// An expandable-segments upstream over CUDA virtual memory management.
///
/// It reserves one virtual range as large as the device's memory
/// (`cuMemAddressReserve`) and maps physical chunks (`cuMemCreate`,
/// `cuMemMap`, `cuMemSetAccess`) at the end of what is mapped, so
/// [`try_extend`](Upstream::try_extend) can grow the pool's last chunk in
/// place and new memory coalesces with the old tail. Freed chunks are
/// unmapped and released (`cuMemUnmap`, `cuMemRelease`).
#[derive(Debug)]
pub struct CudaVmm {
    inner: Expandable,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl CudaVmm {
    /// An upstream on device `ordinal` whose reservation is the device's
    /// total memory (`cuDeviceTotalMem`) rounded up to the granularity.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback, [`Error::UnsupportedMode`]
    /// without VMM support, a driver error.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = device_context(ordinal)?.ok_or(Error::NeedsGpu("CudaVmm"))?;
        // SAFETY: the device handle comes from a live context.
        let total = unsafe { cudarc::driver::result::device::total_mem(ctx.cu_device()) }
            .map_err(driver_err("cuDeviceTotalMem"))?;
        Self::with_reservation(ordinal, total)
    }

    /// An upstream on device `ordinal` reserving `bytes` of address space
    /// (rounded up to the granularity).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::InvalidSize`] for an absurd size.
    pub fn with_reservation(ordinal: usize, bytes: usize) -> Result<Self> {
        let ctx = device_context(ordinal)?.ok_or(Error::NeedsGpu("CudaVmm"))?;
        vmm::require_vmm(&ctx)?;
        Ok(CudaVmm { inner: Expandable::new(&VmBackend::Cuda(ordinal), bytes)?, ctx })
    }

    /// The same upstream for a pool whose owner waits for the work that
    /// used a chunk before giving it back (graph-private pools, released
    /// after the driver destroyed their graphs): giving chunks back then
    /// waits for no device, which would invalidate captures under way.
    pub(crate) fn owner_settles(self) -> Self {
        lock(&self.inner.region).set_owner_settles();
        self
    }

    /// The first address of the reserved range.
    pub fn base(&self) -> u64 {
        self.inner.base as u64
    }

    /// The bytes of address space reserved.
    pub fn reserved(&self) -> usize {
        self.inner.reserved
    }

    /// The bytes of device memory mapped now.
    pub fn mapped(&self) -> usize {
        self.inner.mapped()
    }
}

impl Upstream for CudaVmm {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.allocate_chunk(size, PoolKind::Device)
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.deallocate_chunk(chunk)
    }
    fn try_extend(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.try_extend(chunk, extra, PoolKind::Device)
    }
    fn can_extend(&self) -> bool {
        true
    }
    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.try_shrink(chunk, amount)
    }
    fn can_remap(&self) -> bool {
        true
    }
    fn reserve_chunk(&self, size: usize) -> Result<Chunk> {
        self.inner.reserve_chunk(size, PoolKind::Device)
    }
    fn try_extend_reserved(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        Ok(self.inner.try_extend_reserved(chunk, extra))
    }
    fn map_runs(&self, runs: &[Chunk]) -> Result<u64> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.map_runs(runs, PoolKind::Device, &|| self.device_free().unwrap_or(usize::MAX))
    }
    fn lend_within(&self, spans: &[Chunk], want: usize, queued: Queued) -> Result<Vec<Chunk>> {
        // (A fence is made only on a stream that does not capture, and the
        // wait for it, later, runs in relaxed capture mode.)
        let waits = queued.waits();
        let lent = {
            let _relaxed = RelaxedCaptureMode::enter();
            self.inner.lend_within(spans, want, queued)
        };
        match lent {
            Some(lent) => lent,
            // Unmapped instead, after the same wait (none while a capture
            // is under way).
            None => self.unmap_within(spans, want, waits, true),
        }
    }
    fn unmap_stale(&self, most: usize, wait: bool) -> usize {
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.unmap_stale(most, wait)
    }
    fn has_stale(&self) -> bool {
        self.inner.has_stale()
    }
    fn unmap_within(&self, spans: &[Chunk], want: usize, pending: bool, keep: bool) -> Result<Vec<Chunk>> {
        // Waiting for the device would break a capture under way: keep the
        // pages mapped then (the pool grows instead).
        if pending && captures_under_way() {
            return Ok(Vec::new());
        }
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.unmap_within(spans, want, pending, keep)
    }
    fn release_kept(&self) {
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.release_kept();
    }
    fn kept(&self) -> usize {
        self.inner.kept()
    }
    fn trim_kept(&self, keep: usize) {
        let _relaxed = RelaxedCaptureMode::enter();
        self.inner.trim_kept(keep);
    }
    fn granularity(&self) -> usize {
        self.inner.granularity
    }
    fn name(&self) -> &'static str {
        "cuMemCreate+cuMemMap (expandable)"
    }
    fn host_accessible(&self) -> bool {
        false
    }
    fn device_free(&self) -> Option<usize> {
        vmm::memory_info(&self.ctx).ok().map(|(free, _)| free)
    }
    fn mapped_pieces(&self, addr: usize, size: usize) -> Option<Vec<Chunk>> {
        self.inner.mapped_pieces(addr, size)
    }
}

/// An expandable-segments upstream over host address space: the fallback
/// twin of [`CudaVmm`]. It reserves one range (`mmap(PROT_NONE)`), commits
/// chunks with `mprotect(PROT_READ | PROT_WRITE)` and decommits them with
/// `madvise(MADV_DONTNEED)` and `PROT_NONE`.
#[derive(Debug)]
pub struct HostExpandable {
    inner: Expandable,
}

impl HostExpandable {
    /// An upstream reserving `bytes` of host address space (rounded up to
    /// the page size). Nothing is committed until chunks are allocated.
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for an empty or absurd size; [`Error::Os`]
    /// when `mmap` fails.
    pub fn new(bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::InvalidSize { size: 0, reason: "an expandable segment can't reserve nothing" });
        }
        Ok(HostExpandable { inner: Expandable::new(&VmBackend::Host, bytes)? })
    }

    /// The first address of the reserved range.
    pub fn base(&self) -> usize {
        self.inner.base
    }

    /// The bytes of address space reserved.
    pub fn reserved(&self) -> usize {
        self.inner.reserved
    }

    /// The bytes committed now.
    pub fn mapped(&self) -> usize {
        self.inner.mapped()
    }
}

impl Upstream for HostExpandable {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        self.inner.allocate_chunk(size, PoolKind::Standalone)
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        self.inner.deallocate_chunk(chunk)
    }
    fn try_extend(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        self.inner.try_extend(chunk, extra, PoolKind::Standalone)
    }
    fn can_extend(&self) -> bool {
        true
    }
    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        self.inner.try_shrink(chunk, amount)
    }
    fn can_remap(&self) -> bool {
        true
    }
    fn reserve_chunk(&self, size: usize) -> Result<Chunk> {
        self.inner.reserve_chunk(size, PoolKind::Standalone)
    }
    fn try_extend_reserved(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        Ok(self.inner.try_extend_reserved(chunk, extra))
    }
    fn map_runs(&self, runs: &[Chunk]) -> Result<u64> {
        self.inner.map_runs(runs, PoolKind::Standalone, &|| usize::MAX)
    }
    fn unmap_within(&self, spans: &[Chunk], want: usize, pending: bool, keep: bool) -> Result<Vec<Chunk>> {
        // Host queues run their work at once: nothing to wait for.
        let _ = pending;
        self.inner.unmap_within(spans, want, false, keep)
    }
    fn release_kept(&self) {
        self.inner.release_kept();
    }
    fn kept(&self) -> usize {
        self.inner.kept()
    }
    fn trim_kept(&self, keep: usize) {
        self.inner.trim_kept(keep);
    }
    fn granularity(&self) -> usize {
        self.inner.granularity
    }
    fn name(&self) -> &'static str {
        "host mmap (expandable fallback)"
    }
    fn host_accessible(&self) -> bool {
        true
    }
    fn mapped_pieces(&self, addr: usize, size: usize) -> Option<Vec<Chunk>> {
        self.inner.mapped_pieces(addr, size)
    }
}
