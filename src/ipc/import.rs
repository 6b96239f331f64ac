//! The importer's side: another process's block opened here.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::{HandleKind, IpcHandle};
use crate::cuda::vmm::{self, AddressRange, PhysicalChunk};
use crate::cuda::{device_context, follow_active_peers, ipc, mapped_peers};
use crate::error::{Error, Result};

/// How the memory was opened, and so how it is closed.
enum Opened {
    /// Imported pieces mapped into a range of this process.
    Mapped { range: AddressRange, _pieces: Vec<PhysicalChunk>, mapped: usize },
    /// A `cuIpcOpenMemHandle` base.
    Allocation { base: u64 },
    /// An imported pool and its one imported pointer.
    NativePool { pool: sys::CUmemoryPool, ptr: u64 },
    /// Closed already.
    Closed,
}

/// Another process's device block, usable here by kernels and copies of
/// one device ([`device`](Self::device)) until it is closed. The memory is
/// unmapped or closed on drop as by [`close`](Self::close) (errors are
/// printed), but only [`close_and_notify`](Self::close_and_notify) tells
/// the exporter, which keeps the block pinned until it hears.
pub struct ImportedMemory {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    ptr: u64,
    size: usize,
    id: u64,
    pid: u32,
    opened: Opened,
}

// SAFETY: the raw pool handle (the only field that is not Send/Sync) is a
// driver handle usable from any thread; every call binds the context first,
// and closing needs `self` by value or `&mut self`.
unsafe impl Send for ImportedMemory {}
// SAFETY: shared references only read plain fields.
unsafe impl Sync for ImportedMemory {}

impl std::fmt::Debug for ImportedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("device", &self.ordinal)
            .field("export_id", &self.id)
            .field("exporter_pid", &self.pid)
            .finish()
    }
}

impl ImportedMemory {
    /// Opens the block `handle` describes for kernels and copies on device
    /// `device` (by ordinal in this process; `None`: the device the memory
    /// lives on, found by its UUID). Another device than the memory's
    /// reaches it through peer access, which the device pair must support.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] without a GPU; [`Error::Ipc`] when the memory's
    /// device is not visible here and no device was named; a driver error
    /// (for example a `cuIpcMemHandle` opened in the process that made it,
    /// which the driver refuses, or a device that can't reach the memory).
    pub fn open(handle: IpcHandle, device: Option<usize>) -> Result<ImportedMemory> {
        let owner = ipc::ordinal_of_uuid(&handle.uuid);
        let ordinal = device.or(owner).ok_or_else(|| {
            Error::Ipc(format!(
                "the exported memory's device (UUID {}) is not visible in this process; name a device to open it on",
                uuid_text(&handle.uuid)
            ))
        })?;
        let ctx = device_context(ordinal)?.ok_or(Error::NeedsGpu("importing another process's device memory"))?;
        let size = handle.size as usize;
        let offset = handle.offset;
        let (ptr, opened) = match &handle.kind {
            HandleKind::Mapped { pieces } => {
                // The memory's own device and the peers cumem's own mappings
                // of it name now (`cuda/peer.rs`); peers that become active
                // later are not followed into imports.
                follow_active_peers()?;
                let reach: Vec<usize> =
                    owner.into_iter().flat_map(|o| std::iter::once(o).chain(mapped_peers(o))).collect();
                let (base, opened) = map_pieces(&ctx, pieces, &handle, &reach)?;
                (base + offset, opened)
            }
            HandleKind::Allocation { handle: h } => {
                let base = ipc::open_ipc_handle(&ctx, h)?;
                (base + offset, Opened::Allocation { base })
            }
            HandleKind::NativePool { data } => {
                let fd = handle.fds[0].as_fd();
                let pool = match ipc::import_pool(&ctx, fd, true) {
                    Ok(p) => p,
                    // The memory's own device may refuse an access grant.
                    Err(_) if owner == Some(ordinal) => ipc::import_pool(&ctx, fd, false)?,
                    Err(e) => return Err(e),
                };
                match ipc::import_pool_pointer(&ctx, pool, data) {
                    Ok(ptr) => (ptr + offset, Opened::NativePool { pool, ptr }),
                    Err(e) => {
                        // SAFETY: just imported, no pointer imported.
                        let _ = unsafe { sys::cuMemPoolDestroy(pool) };
                        return Err(e);
                    }
                }
            }
        };
        // The descriptors close here: the imports hold the memory now.
        Ok(ImportedMemory { ctx, ordinal, ptr, size, id: handle.id, pid: handle.pid, opened })
    }

    /// The block's address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The block's size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device (ordinal in this process) the memory was opened for.
    pub fn device(&self) -> usize {
        self.ordinal
    }

    /// The export's id in the exporting process.
    pub fn export_id(&self) -> u64 {
        self.id
    }

    /// The exporting process.
    pub fn exporter_pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the device's work (`cuCtxSynchronize`: work queued here may
    /// still use the memory), then unmaps or closes it.
    ///
    /// # Errors
    /// A driver error; the memory is left open then.
    pub fn close(mut self) -> Result<()> {
        self.close_now()
    }

    /// [`close`](Self::close), then tells the exporter over `socket` that
    /// this process no longer uses the block ([`super::send_closed`]).
    ///
    /// # Errors
    /// As [`close`](Self::close) (nothing sent), or [`Error::Os`] (socket).
    pub fn close_and_notify(mut self, socket: &UnixStream) -> Result<()> {
        self.close_now()?;
        super::send_closed(socket, self.id)
    }

    fn close_now(&mut self) -> Result<()> {
        if matches!(self.opened, Opened::Closed) {
            return Ok(());
        }
        vmm::synchronize(&self.ctx)?;
        let mut opened = std::mem::replace(&mut self.opened, Opened::Closed);
        match &mut opened {
            Opened::Mapped { range, mapped, .. } => {
                if *mapped > 0 {
                    if let Err(e) = range.unmap(0, *mapped) {
                        // Still mapped: keep it (a later close tries again).
                        self.opened = opened;
                        return Err(e);
                    }
                    *mapped = 0;
                }
                // The range is freed, then the pieces released.
                Ok(())
            }
            // SAFETY: the device is idle; the memory is closed before any use.
            Opened::Allocation { base } => unsafe { ipc::close_ipc_handle(&self.ctx, *base) },
            // SAFETY: as above.
            Opened::NativePool { pool, ptr } => unsafe { ipc::close_pool_import(&self.ctx, *pool, *ptr) },
            Opened::Closed => Ok(()),
        }
    }
}

/// Imports each piece of a mapped handle and maps them, in order, into one
/// new range of `ctx` with read-write access for its device and the
/// devices in `reach`; returns the range's first address.
fn map_pieces(ctx: &Arc<CudaContext>, pieces: &[u64], handle: &IpcHandle, reach: &[usize]) -> Result<(u64, Opened)> {
    let total: u64 = pieces.iter().sum();
    let range = AddressRange::reserve(ctx, total as usize, 0)?;
    let mut held = Vec::with_capacity(pieces.len());
    let mut mapped = 0usize;
    let result = (|| {
        for (&piece, fd) in pieces.iter().zip(&handle.fds) {
            let chunk = PhysicalChunk::import(ctx, fd.as_fd(), piece as usize)?;
            range.map(mapped, &chunk)?;
            held.push(chunk);
            mapped += piece as usize;
        }
        range.set_access(0, total as usize, reach)
    })();
    // On an error, dropping `Opened` unmaps what was mapped.
    let base = range.ptr();
    let opened = Opened::Mapped { range, _pieces: held, mapped };
    result.map(|()| (base, opened))
}

impl Drop for Opened {
    fn drop(&mut self) {
        // A half-made mapping (an error while opening) is unmapped here;
        // whole ones are closed by `ImportedMemory`.
        if let Opened::Mapped { range, mapped, .. } = self {
            if *mapped > 0 {
                if let Err(e) = range.unmap(0, *mapped) {
                    eprintln!("cumem: unmapping imported memory: {e}");
                }
            }
        }
    }
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        if let Err(e) = self.close_now() {
            eprintln!("cumem: closing imported memory {:#x} (export {}): {e}", self.ptr, self.id);
        }
    }
}

fn uuid_text(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}
