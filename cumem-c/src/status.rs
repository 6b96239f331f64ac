//! Status codes, the thread-local last error, and the guard every entry
//! point runs in (a panic becomes [`CumemStatus::Panic`], never unwinds).

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cumem::Error;

/// What a cumem call returned. `CUMEM_STATUS_OK` is 0; every other value
/// is a failure whose message [`cumem_last_error`] gives, and which left
/// the pools as they were.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CumemStatus {
    /// Success.
    Ok = 0,
    /// A null pointer where one is required, a zero or absurd size, a bad
    /// alignment, a mode or device number out of range.
    InvalidArgument = 1,
    /// The pool could not serve the request, even after releasing its cache.
    OutOfMemory = 2,
    /// A pointer cumem never handed out (or a pinned pointer given to a
    /// device call, and the reverse).
    UnknownPointer = 3,
    /// A pointer inside a block rather than at its start.
    InteriorPointer = 4,
    /// A block freed a second time.
    DoubleFree = 5,
    /// `cumem_init` after the manager was created (by `cumem_init` or by
    /// any other call, which configures it from `CUMEM_CONF`).
    AlreadyInitialized = 6,
    /// A setting changed too late (pool sizes after the first allocation).
    ConfigTooLate = 7,
    /// A bad configuration string (`cumem_init`'s or `CUMEM_CONF`).
    Config = 8,
    /// A call after `cumem_shutdown`.
    ShutDown = 9,
    /// A CUDA driver call failed.
    Driver = 10,
    /// No device with that number.
    NoSuchDevice = 11,
    /// A request that graph capture rules forbid now.
    Capture = 12,
    /// The caller's buffer is too small (the size needed is reported).
    BufferTooSmall = 13,
    /// A call that needs a GPU on the host fallback.
    NeedsGpu = 14,
    /// cumem panicked inside the call (a bug in cumem): the call did
    /// nothing that can be relied on, and the message says where.
    Panic = 15,
    /// Any other failure; the message says what.
    Other = 16,
    /// Sharing memory with another process failed: memory that can't be
    /// exported, a malformed handle, an unknown export, a closed socket.
    Ipc = 17,
    /// A memory tag's state forbids the request (allocating in a tag that
    /// sleeps, sleeping twice, waking a tag that is awake), or its memory
    /// can't sleep; nothing changed.
    Tag = 18,
}

/// Every status with its name in the header, in the order of their values.
const NAMES: [(CumemStatus, &std::ffi::CStr); 19] = [
    (CumemStatus::Ok, c"CUMEM_STATUS_OK"),
    (CumemStatus::InvalidArgument, c"CUMEM_STATUS_INVALID_ARGUMENT"),
    (CumemStatus::OutOfMemory, c"CUMEM_STATUS_OUT_OF_MEMORY"),
    (CumemStatus::UnknownPointer, c"CUMEM_STATUS_UNKNOWN_POINTER"),
    (CumemStatus::InteriorPointer, c"CUMEM_STATUS_INTERIOR_POINTER"),
    (CumemStatus::DoubleFree, c"CUMEM_STATUS_DOUBLE_FREE"),
    (CumemStatus::AlreadyInitialized, c"CUMEM_STATUS_ALREADY_INITIALIZED"),
    (CumemStatus::ConfigTooLate, c"CUMEM_STATUS_CONFIG_TOO_LATE"),
    (CumemStatus::Config, c"CUMEM_STATUS_CONFIG"),
    (CumemStatus::ShutDown, c"CUMEM_STATUS_SHUT_DOWN"),
    (CumemStatus::Driver, c"CUMEM_STATUS_DRIVER"),
    (CumemStatus::NoSuchDevice, c"CUMEM_STATUS_NO_SUCH_DEVICE"),
    (CumemStatus::Capture, c"CUMEM_STATUS_CAPTURE"),
    (CumemStatus::BufferTooSmall, c"CUMEM_STATUS_BUFFER_TOO_SMALL"),
    (CumemStatus::NeedsGpu, c"CUMEM_STATUS_NEEDS_GPU"),
    (CumemStatus::Panic, c"CUMEM_STATUS_PANIC"),
    (CumemStatus::Other, c"CUMEM_STATUS_OTHER"),
    (CumemStatus::Ipc, c"CUMEM_STATUS_IPC"),
    (CumemStatus::Tag, c"CUMEM_STATUS_TAG"),
];

impl CumemStatus {
    /// The status a cumem error maps to.
    pub fn of(e: &Error) -> CumemStatus {
        match e {
            Error::OutOfMemory { .. } => CumemStatus::OutOfMemory,
            Error::InvalidSize { .. } | Error::InvalidAlignment { .. } => CumemStatus::InvalidArgument,
            Error::UnknownPointer { .. } => CumemStatus::UnknownPointer,
            Error::InteriorPointer { .. } => CumemStatus::InteriorPointer,
            Error::DoubleFree { .. } => CumemStatus::DoubleFree,
            Error::AlreadyInitialized => CumemStatus::AlreadyInitialized,
            Error::ConfigTooLate { .. } => CumemStatus::ConfigTooLate,
            Error::Config(_) => CumemStatus::Config,
            Error::ShutDown(_) => CumemStatus::ShutDown,
            Error::Driver { .. } => CumemStatus::Driver,
            Error::NoSuchDevice { .. } => CumemStatus::NoSuchDevice,
            Error::Capture(_) => CumemStatus::Capture,
            Error::NeedsGpu(_) => CumemStatus::NeedsGpu,
            Error::Ipc(_) => CumemStatus::Ipc,
            Error::Tag { .. } => CumemStatus::Tag,
            _ => CumemStatus::Other,
        }
    }

    /// The status's name as it appears in the header.
    pub fn name(self) -> &'static std::ffi::CStr {
        NAMES[self as usize].1
    }
}

/// A failure on its way to C: the status and the message.
#[derive(Debug)]
pub struct Failure {
    pub(crate) status: CumemStatus,
    pub(crate) message: String,
}

impl Failure {
    /// A failure with this status and message.
    pub fn new(status: CumemStatus, message: impl Into<String>) -> Failure {
        Failure { status, message: message.into() }
    }

    /// A null pointer where the argument `what` must point somewhere.
    pub fn null(what: &str) -> Failure {
        Failure::new(CumemStatus::InvalidArgument, format!("{what} is a null pointer"))
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure { status: CumemStatus::of(&e), message: e.to_string() }
    }
}

/// What an entry point's body returns.
pub type Outcome<T = ()> = std::result::Result<T, Failure>;

thread_local! {
    /// The message of the last failing call on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error.
pub(crate) fn set_last_error(message: &str) {
    // A message with an interior NUL (never made by cumem) is cut there.
    let end = message.find('\0').unwrap_or(message.len());
    let text = CString::new(&message[..end]).unwrap_or_default();
    // `try_with`: in thread teardown the slot may be gone; the status tells.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = text);
}

/// Runs an entry point's body: its failure (or panic) becomes a status
/// and this thread's last error; success is [`CumemStatus::Ok`].
pub(crate) fn guard(body: impl FnOnce() -> Outcome) -> CumemStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CumemStatus::Ok,
        Ok(Err(f)) => {
            set_last_error(&f.message);
            f.status
        }
        Err(payload) => {
            set_last_error(&panic_message(payload.as_ref()));
            CumemStatus::Panic
        }
    }
}

/// The text of a caught panic.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    format!("cumem panicked inside the call (a bug in cumem; please report it): {what}")
}

/// The message of the last failing cumem call on the calling thread ("" if
/// none failed yet; successful calls leave it). The text stays valid until
/// the next failing cumem call on this thread: copy it to keep it.
#[no_mangle]
pub extern "C" fn cumem_last_error() -> *const c_char {
    catch_unwind(|| LAST_ERROR.try_with(|slot| slot.borrow().as_ptr()).unwrap_or(c"".as_ptr())).unwrap_or(c"".as_ptr())
}

/// The name of a status code as a static string ("CUMEM_STATUS_OK", ...);
/// "CUMEM_STATUS_UNKNOWN" for a value that is not one.
#[no_mangle]
pub extern "C" fn cumem_status_name(status: i32) -> *const c_char {
    NAMES.iter().find(|(s, _)| *s as i32 == status).map_or(c"CUMEM_STATUS_UNKNOWN".as_ptr(), |(_, n)| n.as_ptr())
}

#[cfg(test)]
mod tests;
