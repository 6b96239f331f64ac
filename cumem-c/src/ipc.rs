//! Device memory shared with other processes (`cumem::ipc`) in C form.
//! The handle travels over a connected Unix stream socket the caller owns
//! (descriptors as `SCM_RIGHTS`); the exporter keeps the block pinned
//! until the importer has closed it and said so on the same socket.
//!
//! ```text
//!  exporter                                importer
//!  cumem_ipc_export(ptr, sock, &id)  --->  cumem_ipc_import(sock, -1, &p, &n, &id)
//!  cumem_free_device(ptr)  (deferred)      ... kernels on p ...
//!  cumem_ipc_wait_closed(sock, id)   <---  cumem_ipc_close(p, sock)
//!  (the free takes effect here)
//! ```

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

use cumem::ipc::{Export, ImportedMemory, IpcHandle};
use cumem::Error;

use crate::ffi::manager;
use crate::ffi::{put, put_opt};
use crate::status::{guard, Failure, Outcome};
use crate::CumemStatus;

/// Exports not yet released, by id.
static EXPORTS: Mutex<Option<HashMap<u64, Export<'static>>>> = Mutex::new(None);
/// Imported memory not yet closed, by address here.
static IMPORTS: Mutex<Option<HashMap<u64, ImportedMemory>>> = Mutex::new(None);

fn lock<T>(m: &'static Mutex<Option<HashMap<u64, T>>>) -> std::sync::MutexGuard<'static, Option<HashMap<u64, T>>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Socket failures are sharing failures here.
fn ipc_failure(e: Error) -> Failure {
    match e {
        Error::Os { .. } => Failure::new(CumemStatus::Ipc, e.to_string()),
        e => e.into(),
    }
}

/// Runs `f` on the caller's socket without taking it over (or closing it).
fn with_socket<T>(fd: c_int, f: impl FnOnce(&UnixStream) -> cumem::Result<T>) -> Outcome<T> {
    if fd < 0 {
        return Err(Failure::new(CumemStatus::InvalidArgument, format!("socket {fd} is not a descriptor")));
    }
    // SAFETY: the caller promises `fd` is an open socket; the stream is
    // never dropped (ManuallyDrop), so the descriptor stays the caller's.
    let socket = ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(fd) });
    f(&socket).map_err(ipc_failure)
}

/// Exports the live device block at `ptr` (its start) over the connected
/// Unix stream socket `socket`, storing the export's id in `*export_id`.
/// The block stays until the export is released (`cumem_ipc_wait_closed`,
/// `cumem_ipc_release`); a free meanwhile takes effect then.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `export_id`, a negative socket),
/// `CUMEM_STATUS_UNKNOWN_POINTER` / `INTERIOR_POINTER` / `DOUBLE_FREE`,
/// `CUMEM_STATUS_NEEDS_GPU` on the host fallback, `CUMEM_STATUS_IPC`
/// (memory that can't be exported, the socket failed), `CUMEM_STATUS_DRIVER`.
/// Nothing is pinned after a failure.
///
/// # Safety
/// `export_id` must be NULL or valid for a write; `socket` an open Unix
/// stream socket.
#[no_mangle]
pub unsafe extern "C" fn cumem_ipc_export(ptr: *mut c_void, socket: c_int, export_id: *mut u64) -> CumemStatus {
    guard(|| {
        if export_id.is_null() {
            return Err(Failure::null("export_id"));
        }
        if socket < 0 {
            return Err(Failure::new(CumemStatus::InvalidArgument, format!("socket {socket} is not a descriptor")));
        }
        let export = manager()?.export_device(ptr as usize as u64)?;
        let id = export.id();
        if let Err(e) = with_socket(socket, |s| export.send(s)) {
            // Nobody received it: unpin at once.
            let _ = export.release();
            return Err(e);
        }
        lock(&EXPORTS).get_or_insert_with(HashMap::new).insert(id, export);
        // SAFETY: checked non-null; the caller's promise.
        unsafe { put(export_id, "export_id", id) }
    })
}

/// Waits on `socket` for the importer's "closed" for `export_id`; releases it.
///
/// # Errors
/// `CUMEM_STATUS_IPC` for an unknown export, a message about another
/// export, or a socket that failed; the export then stays open (release it
/// with `cumem_ipc_release` once the importer is known to be gone).
#[no_mangle]
pub extern "C" fn cumem_ipc_wait_closed(socket: c_int, export_id: u64) -> CumemStatus {
    guard(|| {
        let export = lock(&EXPORTS).as_mut().and_then(|m| m.remove(&export_id));
        let mut export = export.ok_or_else(|| Failure::new(CumemStatus::Ipc, format!("no open export {export_id}")))?;
        let r = with_socket(socket, |s| export.wait_closed(s));
        if !export.is_released() {
            // Still open, for `cumem_ipc_release` once the importer is gone.
            lock(&EXPORTS).get_or_insert_with(HashMap::new).insert(export_id, export);
        }
        r
    })
}

/// Releases `export_id` with no message (the importer's close known otherwise).
///
/// # Errors
/// `CUMEM_STATUS_IPC` for an unknown export; the deferred free's error.
#[no_mangle]
pub extern "C" fn cumem_ipc_release(export_id: u64) -> CumemStatus {
    guard(|| {
        let export = lock(&EXPORTS).as_mut().and_then(|m| m.remove(&export_id));
        let export = export.ok_or_else(|| Failure::new(CumemStatus::Ipc, format!("no open export {export_id}")))?;
        Ok(export.release()?)
    })
}

/// Receives a handle on `socket` and opens the block for device `device`
/// (-1: the device the memory lives on); stores its address here in
/// `*ptr` (device memory: never dereferenced on the host), its size in
/// `*size` and the export's id in `*export_id` (each may be NULL).
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `ptr`, a negative socket, a device
/// below -1), `CUMEM_STATUS_IPC` (malformed message, socket failed),
/// `CUMEM_STATUS_NEEDS_GPU`, `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `ptr` must be valid for a write; `size` and `export_id` NULL or valid
/// for a write; `socket` an open Unix stream socket.
#[no_mangle]
pub unsafe extern "C" fn cumem_ipc_import(
    socket: c_int,
    device: c_int,
    ptr: *mut *mut c_void,
    size: *mut usize,
    export_id: *mut u64,
) -> CumemStatus {
    guard(|| {
        if ptr.is_null() {
            return Err(Failure::null("ptr"));
        }
        let device = match device {
            -1 => None,
            d if d >= 0 => Some(d as usize),
            d => return Err(Failure::new(CumemStatus::InvalidArgument, format!("device {d}"))),
        };
        let handle = with_socket(socket, IpcHandle::recv)?;
        let memory = ImportedMemory::open(handle, device)?;
        let (p, n, id) = (memory.ptr(), memory.size(), memory.export_id());
        lock(&IMPORTS).get_or_insert_with(HashMap::new).insert(p, memory);
        // SAFETY: the caller's promise about `size`.
        unsafe { put_opt(size, n) };
        // SAFETY: the caller's promise about `export_id`.
        unsafe { put_opt(export_id, id) };
        // SAFETY: checked non-null; the caller's promise.
        unsafe { put(ptr, "ptr", p as usize as *mut c_void) }
    })
}

/// Closes imported memory (after the device's work on it is done) and,
/// when `socket` is not -1, tells the exporter on it.
///
/// # Errors
/// `CUMEM_STATUS_UNKNOWN_POINTER` for an address that is not open imported
/// memory; `CUMEM_STATUS_DRIVER` (nothing is sent then); `CUMEM_STATUS_IPC`
/// when the message could not be sent (the memory is closed);
/// `CUMEM_STATUS_INVALID_ARGUMENT` for a socket below -1 (the memory is
/// closed, nothing is sent).
#[no_mangle]
pub extern "C" fn cumem_ipc_close(ptr: *mut c_void, socket: c_int) -> CumemStatus {
    guard(|| {
        let key = ptr as usize as u64;
        let memory = lock(&IMPORTS).as_mut().and_then(|m| m.remove(&key));
        let memory = memory.ok_or_else(|| {
            Failure::new(CumemStatus::UnknownPointer, format!("{key:#x} is not open imported memory"))
        })?;
        if socket == -1 {
            return Ok(memory.close()?);
        }
        with_socket(socket, |s| memory.close_and_notify(s))
    })
}
