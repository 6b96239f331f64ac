//! Raw CUDA streams from C (`cudaStream_t`, `CUstream`) as [`Stream`]s.
//!
//! cumem orders reuse by stream identity, so one raw stream must always be
//! the same `Stream`: the first time a raw stream of a device is seen, it
//! is wrapped (cudarc's `wrap_borrowed_stream`: the wrapper never destroys
//! it) and kept in a process-wide table; each thread keeps a small copy of
//! the table's entries it used, so a call on a known stream takes no
//! shared lock. Streams made by [`cumem_stream_create`] are in the same
//! table, owned: [`cumem_stream_destroy`] drops them.
//!
//! The table stays bounded while a program makes and destroys streams of
//! its own forever: [`cumem_stream_forget`] (called before the program
//! destroys a stream cumem saw) waits once for the stream's work, drops
//! its entry, and cumem never touches the handle again; and whenever the
//! table has doubled since the last look, entries of foreign streams with
//! no free still pending are dropped (nothing waits for them; seen again,
//! a raw stream gets a fresh identity, which is correct). Like PyTorch's
//! allocator, cumem keeps no stream only because it saw it once.
//!
//! On the host fallback every raw value stands for a host queue of its own
//! (work "queued" on it has already happened).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use cumem::Stream;

use crate::status::{Failure, Outcome};
use crate::CumemStatus;

/// A raw CUDA stream (`cudaStream_t`, `CUstream`); NULL is the device's
/// legacy default stream. On the host fallback, any value is a host queue.
pub type CumemStream = *mut c_void;

/// (device, raw stream value).
type Key = (usize, usize);

struct Entry {
    stream: Stream,
    /// Made by `cumem_stream_create` (destroyed by `cumem_stream_destroy`).
    owned: bool,
}

#[derive(Default)]
struct Table {
    map: HashMap<Key, Entry>,
    /// Look for entries to drop when `map` reaches this many.
    prune_at: usize,
}

/// Entries kept before the first look for ones to drop.
const PRUNE_FIRST: usize = 64;

impl Table {
    /// Drops the entries of foreign streams with no free pending (see the
    /// module docs); returns them, to be dropped after the lock.
    fn prune(&mut self) -> Vec<Entry> {
        let idle: Vec<Key> = self
            .map
            .iter()
            .filter(|(_, e)| !e.owned && (e.stream.is_host() || !e.stream.has_pending_frees()))
            .map(|(k, _)| *k)
            .collect();
        let gone: Vec<Entry> = idle.iter().filter_map(|k| self.map.remove(k)).collect();
        self.prune_at = (self.map.len() * 2).max(PRUNE_FIRST);
        if !gone.is_empty() {
            GENERATION.fetch_add(1, Ordering::AcqRel);
        }
        gone
    }
}

fn table() -> &'static Mutex<Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE.get_or_init(Mutex::default)
}

fn lock_table() -> std::sync::MutexGuard<'static, Table> {
    table().lock().unwrap_or_else(PoisonError::into_inner)
}

/// Bumped whenever an entry leaves the table: threads drop their copies.
static GENERATION: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's copies of table entries, valid for one generation.
    static LOCAL: RefCell<(u64, Vec<(Key, Stream)>)> = const { RefCell::new((0, Vec::new())) };
}

/// How many streams a thread keeps copies of (scanned: programs use few).
const LOCAL_MAX: usize = 16;

/// The cumem stream for raw stream `raw` of device `device`.
///
/// The caller of the C entry point promises that `raw` is a stream of
/// `device`'s primary context (the one the CUDA runtime uses) and that it
/// outlives the frees queued on it.
pub(crate) fn stream_for(device: usize, raw: CumemStream) -> Outcome<Stream> {
    let key = (device, raw as usize);
    let generation = GENERATION.load(Ordering::Acquire);
    // `try_with`: a call from another thread-local's destructor (PyTorch
    // freeing tensors as a thread exits) may come after this thread's
    // copies are gone; the shared table serves it then.
    let hit = LOCAL
        .try_with(|l| {
            let l = l.borrow();
            if l.0 != generation {
                return None;
            }
            l.1.iter().find(|(k, _)| *k == key).map(|(_, s)| s.clone())
        })
        .ok()
        .flatten();
    if let Some(s) = hit {
        return Ok(s);
    }
    let stream = shared_stream(key)?;
    let _ = LOCAL.try_with(|l| {
        let mut l = l.borrow_mut();
        if l.0 != generation {
            *l = (generation, Vec::new());
        }
        if l.1.len() == LOCAL_MAX {
            l.1.remove(0);
        }
        l.1.push((key, stream.clone()));
    });
    Ok(stream)
}

/// The table's stream for `key`, wrapped and entered on first sight.
fn shared_stream(key: Key) -> Outcome<Stream> {
    if let Some(e) = lock_table().map.get(&key) {
        return Ok(e.stream.clone());
    }
    // A device the manager does not have fails here (once per stream:
    // known streams are found above). The allocator and the context may be
    // created here (driver calls): outside the lock.
    crate::ffi::manager()?.device(key.0)?;
    let wrapped = match cumem::device::device_context(key.0)? {
        Some(ctx) => {
            // SAFETY: the C caller promises (see the header) that the raw
            // stream belongs to this device's primary context and outlives
            // the work cumem orders on it; the wrapper is borrowed, so
            // dropping it never destroys the stream.
            let cuda = unsafe { ctx.wrap_borrowed_stream(key.1 as cudarc::driver::sys::CUstream) };
            Stream::from_cudarc(cuda)
        }
        None => Stream::host(),
    };
    let mut t = lock_table();
    // Another thread may have entered it: theirs wins (one identity).
    let stream = t.map.entry(key).or_insert(Entry { stream: wrapped, owned: false }).stream.clone();
    let gone = if t.map.len() >= t.prune_at.max(PRUNE_FIRST) { t.prune() } else { Vec::new() };
    drop(t);
    // The wrappers go outside the lock.
    drop(gone);
    Ok(stream)
}

/// The raw value standing for host queue `s` (never NULL, never a value a
/// real stream has: the host fallback has none).
fn host_token(s: &Stream) -> usize {
    0x1000 + (s.id() as usize) * 16
}

/// Creates a stream on the default device (`cuStreamCreate`,
/// non-blocking), or a host queue on the host fallback, and stores its raw
/// handle in `*out`. Destroy it with `cumem_stream_destroy`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write of one `CumemStream`.
#[no_mangle]
pub unsafe extern "C" fn cumem_stream_create(out: *mut CumemStream) -> CumemStatus {
    let create = || {
        let device = crate::ffi::manager()?.config().device;
        let stream = Stream::new_on(device)?;
        let raw = if stream.is_host() { host_token(&stream) } else { stream.cu_stream() as usize };
        lock_table().map.insert((device, raw), Entry { stream, owned: true });
        Ok(raw as CumemStream)
    };
    // SAFETY: the caller's promise about `out`.
    unsafe { crate::ffi::answer(out, create) }
}

/// Destroys a stream made by `cumem_stream_create` once cumem no longer
/// orders work on it (`cuStreamDestroy`; work already queued still runs).
/// Synchronize it first if memory was freed on it.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` for a stream `cumem_stream_create` did
/// not make (or one already destroyed).
#[no_mangle]
pub extern "C" fn cumem_stream_destroy(stream: CumemStream) -> CumemStatus {
    crate::status::guard(|| {
        let device = crate::ffi::manager()?.config().device;
        let key = (device, stream as usize);
        let mut t = lock_table();
        match t.map.get(&key) {
            Some(e) if e.owned => {
                let entry = t.map.remove(&key);
                GENERATION.fetch_add(1, Ordering::AcqRel);
                drop(t);
                // The wrapper (with its last clone, the stream) goes unlocked.
                drop(entry);
                Ok(())
            }
            _ => Err(Failure::new(
                CumemStatus::InvalidArgument,
                format!("stream {stream:p} was not made by cumem_stream_create (or is already destroyed)"),
            )),
        }
    })
}

/// Waits until all work queued on `stream` (of the default device) is
/// done (`cuStreamSynchronize`); returns at once on the host fallback.
#[no_mangle]
pub extern "C" fn cumem_stream_synchronize(stream: CumemStream) -> CumemStatus {
    crate::status::guard(|| {
        let device = crate::ffi::manager()?.config().device;
        stream_for(device, stream)?.synchronize()?;
        Ok(())
    })
}

/// Call before destroying `stream` (of the default device), one the
/// program made itself, when cumem may have seen it (memory allocated or
/// freed on it). cumem waits once for its queued work
/// (`cuStreamSynchronize`), so every free on it is complete, and never
/// touches the handle again (not even in `cumem_release_cached`); seen
/// again later, the handle is a new stream. A stream cumem never saw, or
/// one already forgotten, is nothing to do.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` for NULL (the legacy default stream)
/// or a stream of `cumem_stream_create` (use `cumem_stream_destroy`); a
/// capture error while the stream captures (nothing changes); a driver
/// error from the wait (the stream is then not forgotten).
#[no_mangle]
pub extern "C" fn cumem_stream_forget(stream: CumemStream) -> CumemStatus {
    crate::status::guard(|| {
        if stream.is_null() {
            return Err(Failure::new(
                CumemStatus::InvalidArgument,
                "the legacy default stream (NULL) is the device's and is never destroyed".to_string(),
            ));
        }
        let device = crate::ffi::manager()?.config().device;
        let key = (device, stream as usize);
        let known = match lock_table().map.get(&key) {
            Some(e) if e.owned => {
                return Err(Failure::new(
                    CumemStatus::InvalidArgument,
                    format!("stream {stream:p} was made by cumem_stream_create: destroy it with cumem_stream_destroy"),
                ))
            }
            Some(e) => Some(e.stream.clone()),
            None => None,
        };
        let Some(s) = known else { return Ok(()) };
        // The wait runs outside the table's lock; every other holder of the
        // stream (the device's stream registry) sees it forgotten.
        s.forget_handle()?;
        let mut t = lock_table();
        // Another thread may have forgotten it (and the handle come back
        // as a new stream) meanwhile: only this identity goes.
        let entry = if t.map.get(&key).is_some_and(|e| e.stream.same_as(&s)) { t.map.remove(&key) } else { None };
        GENERATION.fetch_add(1, Ordering::AcqRel);
        drop(t);
        drop(entry);
        Ok(())
    })
}

/// Stores in `*out` how many raw streams cumem's table holds now (seen
/// through the C ABI or made by `cumem_stream_create`).
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write of one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn cumem_stream_table_size(out: *mut usize) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { crate::ffi::answer(out, || Ok(lock_table().map.len())) }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod gpu_tests;
