//! Device memory shared with other processes.
//!
//! A block of cumem device memory is **exported** in one process
//! ([`MemoryManager::export_device`](crate::MemoryManager::export_device))
//! and **imported** in another ([`ImportedMemory::open`]), on the same GPU
//! or on another GPU of the machine that can reach it (peer access). The
//! [`IpcHandle`] between them carries POSIX file descriptors, so it travels
//! over a Unix socket ([`IpcHandle::send`], [`IpcHandle::recv`]), as
//! `SCM_RIGHTS`.
//!
//! How the memory is shared follows from how cumem made it:
//!
//! | memory | exporter | importer |
//! | --- | --- | --- |
//! | sync pool over CUDA VMM (the default) | `cuMemRetainAllocationHandle` + `cuMemExportToShareableHandle` of each mapped piece under the block | `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess` |
//! | sync pool over `cuMemAlloc` chunks (`expandable=0`) | `cuIpcGetMemHandle` of the chunk | `cuIpcOpenMemHandle` |
//! | `cuda_async_pool` mode with `exportable_native_pool` set | `cuMemPoolExportToShareableHandle` + `cuMemPoolExportPointer` | `cuMemPoolImportFromShareableHandle`, `cuMemPoolSetAccess`, `cuMemPoolImportPointer` |
//!
//! The `async_stream_ordered` mode's memory (the device's default pool)
//! can't be exported, nor memory of a graph-private pool.
//!
//! # Lifetime
//! An exported block is **pinned** until its [`Export`] is released: cumem
//! never hands it out again, moves its memory, or unmaps its
//! pages, even after its owner frees it (the free is then deferred and
//! takes effect at the release). The release says that no importer uses the
//! block any more; the protocol that makes it true is
//! [`ImportedMemory::close_and_notify`] in the importer (after its work on
//! the memory is done) and [`Export::wait_closed`] in the exporter, over
//! the same socket the handle went through. When the importer dies instead,
//! `wait_closed` fails and the export stays open: once the importer's
//! process has exited (the driver unmapped its imports), [`Export::release`]
//! frees the block. An `Export` dropped without a release leaves the block
//! pinned until the process exits: an importer may still be using it.
//!
//! # Examples
//! ```no_run
//! use std::os::unix::net::UnixStream;
//! use cumem::ipc::{ImportedMemory, IpcHandle};
//! use cumem::MemoryManager;
//! # fn main() -> cumem::Result<()> {
//! let (producer, consumer) = UnixStream::pair().expect("a socket pair");
//! // Producer (one process):
//! let mm = MemoryManager::global()?;
//! let ptr = mm.allocate_device(1 << 20)?;
//! let export = mm.export_device(ptr)?;
//! export.send(&producer)?;
//! // Consumer (another process):
//! let memory = ImportedMemory::open(IpcHandle::recv(&consumer)?, None)?;
//! let _device_ptr = memory.ptr(); // for kernels and copies on this GPU
//! memory.close_and_notify(&consumer)?;
//! // Producer again: the block can be freed and reused after this.
//! let mut export = export;
//! export.wait_closed(&producer)?;
//! mm.free_device(ptr)?;
//! # Ok(())
//! # }
//! ```

mod import;
mod wire;

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

pub use import::ImportedMemory;

use crate::error::{Error, Result};

/// How the exported memory is shared (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HandleKind {
    /// VMM pieces, one descriptor each: their sizes, in address order.
    Mapped { pieces: Vec<u64> },
    /// A `cuMemAlloc` allocation: its `cuIpcGetMemHandle`.
    Allocation { handle: [u8; 64] },
    /// An allocation of an exportable native pool (the pool's descriptor):
    /// its `cuMemPoolExportPointer` data.
    NativePool { data: [u8; 64] },
}

/// What an importer needs to open an exported block: a description and
/// the file descriptors of the memory under it. Made by
/// [`MemoryManager::export_device`](crate::MemoryManager::export_device);
/// sent with [`send`](Self::send), received with [`recv`](Self::recv).
#[derive(Debug)]
pub struct IpcHandle {
    pub(crate) kind: HandleKind,
    pub(crate) id: u64,
    pub(crate) pid: u32,
    pub(crate) uuid: [u8; 16],
    pub(crate) size: u64,
    pub(crate) offset: u64,
    pub(crate) fds: Vec<OwnedFd>,
}

impl IpcHandle {
    /// The bytes the exporter asked for when it allocated the block (the
    /// memory shared may be larger: the pool rounds blocks up).
    pub fn size(&self) -> usize {
        self.size as usize
    }

    /// The export this handle belongs to: unique in the exporting process.
    pub fn export_id(&self) -> u64 {
        self.id
    }

    /// The exporting process.
    pub fn exporter_pid(&self) -> u32 {
        self.pid
    }

    /// The UUID of the device the memory lives on (`cuDeviceGetUuid`).
    pub fn device_uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// How the memory is shared: `"vmm"`, `"cuIpcMemHandle"`, `"native pool"`.
    pub fn mechanism(&self) -> &'static str {
        match self.kind {
            HandleKind::Mapped { .. } => "vmm",
            HandleKind::Allocation { .. } => "cuIpcMemHandle",
            HandleKind::NativePool { .. } => "native pool",
        }
    }

    /// Sends the handle over a connected Unix stream socket (descriptors
    /// as `SCM_RIGHTS`). The descriptors stay open here too.
    ///
    /// # Errors
    /// [`Error::Os`] when the socket fails.
    pub fn send(&self, socket: &UnixStream) -> Result<()> {
        wire::send_handle(socket, self)
    }

    /// Receives a handle sent with [`send`](Self::send).
    ///
    /// # Errors
    /// [`Error::Os`] when the socket fails; [`Error::Ipc`] for a malformed
    /// message, or a message that is not a handle.
    pub fn recv(socket: &UnixStream) -> Result<IpcHandle> {
        match wire::recv(socket)? {
            wire::Message::Handle { handle, .. } => Ok(handle),
            wire::Message::Closed { id } => {
                Err(Error::Ipc(format!("expected a handle, received \"export {id} closed\"")))
            }
        }
    }

    /// The handle's bytes without its descriptors, for programs that move
    /// descriptors their own way; [`from_parts`](Self::from_parts) puts
    /// them together again.
    pub fn to_bytes(&self) -> Vec<u8> {
        wire::encode_handle(self)
    }

    /// The descriptors, in [`from_parts`](Self::from_parts)' order.
    pub fn fds(&self) -> &[OwnedFd] {
        &self.fds
    }

    /// A handle from [`to_bytes`](Self::to_bytes) and the descriptors
    /// [`fds`](Self::fds) listed (duplicates are fine).
    ///
    /// # Errors
    /// [`Error::Ipc`] for malformed bytes or a wrong number of descriptors.
    pub fn from_parts(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<IpcHandle> {
        match wire::decode(bytes)? {
            wire::Message::Handle { mut handle, fds: n } if n == fds.len() => {
                handle.fds = fds;
                Ok(handle)
            }
            wire::Message::Handle { fds: n, .. } => {
                Err(Error::Ipc(format!("the handle names {n} descriptors, {} given", fds.len())))
            }
            wire::Message::Closed { .. } => Err(Error::Ipc("these bytes are a \"closed\" message".into())),
        }
    }
}

/// Waits for the next "export closed" message on `socket` and returns the
/// export's id; [`Export::wait_closed`] does this for one export.
///
/// # Errors
/// [`Error::Os`] when the socket fails; [`Error::Ipc`] for another message.
pub fn recv_closed(socket: &UnixStream) -> Result<u64> {
    match wire::recv(socket)? {
        wire::Message::Closed { id } => Ok(id),
        wire::Message::Handle { handle, .. } => {
            Err(Error::Ipc(format!("expected \"export closed\", received the handle of export {}", handle.id)))
        }
    }
}

/// Tells the exporter, over `socket`, that export `id` is closed here
/// ([`ImportedMemory::close_and_notify`] does this after closing).
///
/// # Errors
/// [`Error::Os`] when the socket fails.
pub fn send_closed(socket: &UnixStream, id: u64) -> Result<()> {
    wire::send_closed(socket, id)
}

/// The exporter's side of an [`Export`]: what releases one export of a
/// block (the device allocator that made it).
pub(crate) trait Exporter: std::fmt::Debug + Sync {
    /// Releases one export of the block at `ptr`.
    fn release_export(&self, ptr: u64) -> Result<()>;
}

/// An exported block, pinned until released (see the module docs): the
/// exporter's side of the lifetime protocol.
#[derive(Debug)]
pub struct Export<'a> {
    device: &'a dyn Exporter,
    ptr: u64,
    handle: IpcHandle,
    released: bool,
}

impl<'a> Export<'a> {
    pub(crate) fn new(device: &'a dyn Exporter, ptr: u64, handle: IpcHandle) -> Self {
        Export { device, ptr, handle, released: false }
    }

    /// The exported block's address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The handle an importer opens.
    pub fn handle(&self) -> &IpcHandle {
        &self.handle
    }

    /// The export's id (also the handle's).
    pub fn id(&self) -> u64 {
        self.handle.id
    }

    /// Sends the handle over `socket` ([`IpcHandle::send`]).
    ///
    /// # Errors
    /// As [`IpcHandle::send`].
    pub fn send(&self, socket: &UnixStream) -> Result<()> {
        self.handle.send(socket)
    }

    /// Whether the export was released.
    pub fn is_released(&self) -> bool {
        self.released
    }

    /// Releases the block: no importer uses it any more (it closed the
    /// memory, or its process has exited: the driver then unmapped what it
    /// imported). A free of the block made meanwhile takes effect now;
    /// until then it stays allocated.
    ///
    /// # Errors
    /// The deferred free's error (the block then stays allocated).
    pub fn release(mut self) -> Result<()> {
        self.release_now()
    }

    fn release_now(&mut self) -> Result<()> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        self.device.release_export(self.ptr)
    }

    /// Waits on `socket` for the importer's "closed" message for this
    /// export ([`ImportedMemory::close_and_notify`]), then releases the
    /// block. On an error the export stays open and the block pinned: the
    /// caller may [`release`](Self::release) it once it knows the importer
    /// is gone (for example after its process exited), or drop it, which
    /// keeps the block pinned. Waiting again after a release returns at
    /// once.
    ///
    /// # Errors
    /// [`Error::Os`] when the socket fails (the peer hung up or timed out);
    /// [`Error::Ipc`] for a message about another export (use
    /// [`recv_closed`] to wait for several on one socket).
    pub fn wait_closed(&mut self, socket: &UnixStream) -> Result<()> {
        if self.released {
            return Ok(());
        }
        match recv_closed(socket)? {
            id if id == self.handle.id => self.release_now(),
            other => Err(Error::Ipc(format!(
                "\"export {other} closed\" arrived while waiting for export {}; this export stays open",
                self.id()
            ))),
        }
    }
}

impl Drop for Export<'_> {
    fn drop(&mut self) {
        if !self.released {
            eprintln!(
                "cumem: export {} of device block {:#x} dropped without a release: the block stays allocated \
                 until the process exits (an importer may still use it)",
                self.handle.id, self.ptr
            );
        }
    }
}
