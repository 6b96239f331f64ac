//! Memory tags, sleep and wake in C form: the calling thread's tag
//! (`cumem_tag_set`, `cumem_tag_get`), `cumem_sleep`, `cumem_wake` and
//! the figures of every tag (`cumem_tag_usage`).
//!
//! A tag set on a thread sends that thread's device allocations to the
//! tag's own address space, which sleeps and wakes as one. The C ABI has
//! no scope: a caller that nests tags reads the tag set before
//! (`cumem_tag_get`) and sets it back.

use std::ffi::{c_char, c_int, CStr};

use cumem::{SleepReport, TagState, TagUsage, WakeReport};

use crate::ffi::{answer, copy_text, manager, put, put_opt};
use crate::status::{guard, Failure, Outcome};
use crate::CumemStatus;

/// The longest tag name in bytes, without its NUL.
pub const CUMEM_MAX_TAG_LEN: usize = 128;

/// Bytes of `CumemTagUsage::name`: the longest name and its NUL.
pub const CUMEM_TAG_NAME_CAP: usize = CUMEM_MAX_TAG_LEN + 1;

const _: () = assert!(CUMEM_MAX_TAG_LEN == cumem::device::MAX_TAG_LEN);

/// Where a tag's memory is (`CumemTagUsage::state`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CumemTagState {
    /// Mapped and usable: allocations are served.
    Awake = 0,
    /// Being put to sleep (contents being copied out).
    Sleeping = 1,
    /// Its pages are given back; its addresses stay reserved.
    Asleep = 2,
    /// Getting pages again (contents being copied back).
    Waking = 3,
}

impl CumemTagState {
    fn of(s: TagState) -> CumemTagState {
        match s {
            TagState::Awake => CumemTagState::Awake,
            TagState::Sleeping => CumemTagState::Sleeping,
            TagState::Asleep => CumemTagState::Asleep,
            TagState::Waking => CumemTagState::Waking,
        }
    }
}

/// What `cumem_sleep` did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CumemSleepReport {
    /// How many tags were put to sleep.
    pub tags: usize,
    /// Bytes of live blocks copied to pinned host memory.
    pub offloaded: usize,
    /// Bytes of live blocks whose contents were discarded.
    pub discarded: usize,
    /// Bytes of physical device memory given back.
    pub released: usize,
    /// Seconds spent copying.
    pub copy_seconds: f64,
    /// Seconds the whole call took.
    pub seconds: f64,
}

impl From<&SleepReport> for CumemSleepReport {
    fn from(r: &SleepReport) -> Self {
        CumemSleepReport {
            tags: r.tags.len(),
            offloaded: r.offloaded,
            discarded: r.discarded,
            released: r.released,
            copy_seconds: r.copy_seconds,
            seconds: r.seconds,
        }
    }
}

/// What `cumem_wake` did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CumemWakeReport {
    /// How many tags were woken.
    pub tags: usize,
    /// Bytes of contents copied back.
    pub restored: usize,
    /// Bytes of physical device memory mapped under live blocks.
    pub mapped: usize,
    /// Seconds spent copying.
    pub copy_seconds: f64,
    /// Seconds the whole call took.
    pub seconds: f64,
}

impl From<&WakeReport> for CumemWakeReport {
    fn from(r: &WakeReport) -> Self {
        CumemWakeReport {
            tags: r.tags.len(),
            restored: r.restored,
            mapped: r.mapped,
            copy_seconds: r.copy_seconds,
            seconds: r.seconds,
        }
    }
}

/// One tag on one device (`cumem_tag_usage`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CumemTagUsage {
    /// The tag, NUL-terminated.
    pub name: [c_char; CUMEM_TAG_NAME_CAP],
    /// The device.
    pub device: c_int,
    /// Where its memory is.
    pub state: CumemTagState,
    /// Bytes in its live blocks.
    pub in_use: usize,
    /// Bytes its live allocations asked for.
    pub requested: usize,
    /// Bytes of physical device memory mapped for it now (0 while asleep).
    pub mapped: usize,
    /// Bytes of address space reserved for it (kept while asleep).
    pub reserved: usize,
    /// Its live blocks.
    pub live_blocks: usize,
    /// Bytes of its contents held in pinned host memory while it sleeps.
    pub offloaded: usize,
}

impl CumemTagUsage {
    fn of(u: &TagUsage) -> Outcome<CumemTagUsage> {
        let mut name = [0 as c_char; CUMEM_TAG_NAME_CAP];
        // Names are checked at most CUMEM_MAX_TAG_LEN bytes with no NUL
        // when a tag is set; the last byte stays the NUL.
        for (d, s) in name.iter_mut().zip(u.name.bytes().take(CUMEM_MAX_TAG_LEN)) {
            *d = s as c_char;
        }
        let device = c_int::try_from(u.device)
            .map_err(|_| Failure::new(CumemStatus::Other, format!("device {} does not fit an int", u.device)))?;
        Ok(CumemTagUsage {
            name,
            device,
            state: CumemTagState::of(u.state),
            in_use: u.pool.in_use,
            requested: u.pool.requested,
            mapped: u.pool.mapped,
            reserved: u.pool.reserved,
            live_blocks: u.pool.live_blocks,
            offloaded: u.offloaded,
        })
    }
}

/// A tag name from C.
///
/// # Safety
/// `name` must be non-null and NUL-terminated, and stay valid for `'a`.
unsafe fn tag_name<'a>(name: *const c_char, what: &str) -> Outcome<&'a str> {
    // SAFETY: the caller's promise.
    let text = unsafe { CStr::from_ptr(name) };
    text.to_str().map_err(|_| Failure::new(CumemStatus::Config, format!("{what}: a memory tag's name must be UTF-8")))
}

/// `n` tag names from a C array.
///
/// # Safety
/// `list` must be NULL (only with `n` 0) or valid for reads of `n`
/// pointers, each NULL (an error) or a NUL-terminated string valid for
/// `'a`.
unsafe fn tag_names<'a>(list: *const *const c_char, n: usize, what: &str) -> Outcome<Vec<&'a str>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if list.is_null() {
        return Err(Failure::new(CumemStatus::InvalidArgument, format!("{what} is a null pointer with {n} names")));
    }
    (0..n)
        .map(|i| {
            // SAFETY: `list` is valid for `n` reads (promised) and `i < n`.
            let p = unsafe { list.add(i).read() };
            if p.is_null() {
                return Err(Failure::null(&format!("{what}[{i}]")));
            }
            // SAFETY: non-null, and NUL-terminated (the caller's promise).
            unsafe { tag_name(p, &format!("{what}[{i}]")) }
        })
        .collect()
}

/// Sets `name` as the calling thread's memory tag (NULL clears it): the
/// thread's device allocations now come from the tag's own address space,
/// which `cumem_sleep` and `cumem_wake` put away and bring back as one
/// (not those of a graph capture cumem routes into a private pool).
///
/// # Errors
/// `CUMEM_STATUS_CONFIG`: a name that is empty, longer than
/// `CUMEM_MAX_TAG_LEN` bytes or not UTF-8 (the thread's tag is unchanged).
///
/// # Safety
/// `name` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cumem_tag_set(name: *const c_char) -> CumemStatus {
    guard(|| {
        let name = if name.is_null() {
            None
        } else {
            // SAFETY: non-null, and NUL-terminated (the caller's promise).
            Some(unsafe { tag_name(name, "name") }?)
        };
        cumem::device::set_thread_tag(name)?;
        Ok(())
    })
}

/// Writes the calling thread's memory tag ("" when none is set) into
/// `buf`, as `cumem_memory_summary` does (it needs at most
/// `CUMEM_TAG_NAME_CAP` bytes).
///
/// # Safety
/// `buf` must be NULL or valid for writes of `len` bytes; `needed` NULL or
/// valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_tag_get(buf: *mut c_char, len: usize, needed: *mut usize) -> CumemStatus {
    guard(|| {
        let tag = cumem::device::current_tag();
        // SAFETY: the caller's promises are copy_text's.
        unsafe { copy_text(tag.as_deref().unwrap_or(""), buf, len, needed) }
    })
}

/// Stores 1 in `*out` when the calling thread has a memory tag set, else
/// 0 (a thread-local read, cheap enough for every allocation).
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_tag_is_set(out: *mut c_int) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, || Ok(c_int::from(cumem::device::current_tag().is_some()))) }
}

/// Puts memory tags to sleep: the live blocks of the `n_offload` tags in
/// `offload` are copied to pinned host memory, those of the `n_discard`
/// tags in `discard` are not; then every physical page of these tags goes
/// back to the driver, their addresses kept for `cumem_wake`. From the
/// call (which waits for work queued before it) until `cumem_wake`
/// returns, the tags' memory must not be used; allocating in them fails
/// with `CUMEM_STATUS_TAG`, freeing is fine. Stores what was done in
/// `*out` unless NULL.
///
/// # Errors
/// Nothing is released when the call fails:
/// `CUMEM_STATUS_INVALID_ARGUMENT` (a NULL list with names, a NULL name);
/// `CUMEM_STATUS_CONFIG` (a bad or repeated name, a tag in both lists);
/// `CUMEM_STATUS_TAG` (a tag that never allocated, or that is not awake;
/// too little pinned memory for the offloaded contents);
/// `CUMEM_STATUS_CAPTURE` (a graph capture under way);
/// `CUMEM_STATUS_SHUT_DOWN`, `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `offload` must be NULL (only with `n_offload` 0) or valid for reads of
/// `n_offload` pointers, each a NUL-terminated string; `discard` likewise;
/// `out` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_sleep(
    offload: *const *const c_char,
    n_offload: usize,
    discard: *const *const c_char,
    n_discard: usize,
    out: *mut CumemSleepReport,
) -> CumemStatus {
    guard(|| {
        // SAFETY: the caller's promises about the two lists.
        let (offload, discard) =
            unsafe { (tag_names(offload, n_offload, "offload")?, tag_names(discard, n_discard, "discard")?) };
        let r = manager()?.sleep(&offload, &discard)?;
        // SAFETY: the caller's promise about `out`.
        unsafe { put_opt(out, CumemSleepReport::from(&r)) };
        Ok(())
    })
}

/// Wakes the `n` sleeping tags in `tags` (`n` 0: all): new memory is
/// mapped under their live blocks at the same addresses and the offloaded
/// contents copied back (discarded ones are undefined); graphs captured
/// before the sleep replay as before. Stores what was done in `*out`
/// unless NULL.
///
/// # Errors
/// Nothing changes when the call fails (the tags stay asleep, their
/// contents kept): `CUMEM_STATUS_INVALID_ARGUMENT`, `CUMEM_STATUS_CONFIG`
/// as for `cumem_sleep`; `CUMEM_STATUS_TAG` (a tag that never allocated or
/// is not asleep); `CUMEM_STATUS_OUT_OF_MEMORY`; `CUMEM_STATUS_CAPTURE`;
/// `CUMEM_STATUS_SHUT_DOWN`; `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `tags` must be NULL (only with `n` 0) or valid for reads of `n`
/// pointers, each a NUL-terminated string; `out` NULL or valid for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn cumem_wake(tags: *const *const c_char, n: usize, out: *mut CumemWakeReport) -> CumemStatus {
    guard(|| {
        // SAFETY: the caller's promise about the list.
        let tags = unsafe { tag_names(tags, n, "tags")? };
        let r = manager()?.wake(&tags)?;
        // SAFETY: the caller's promise about `out`.
        unsafe { put_opt(out, CumemWakeReport::from(&r)) };
        Ok(())
    })
}

/// Writes the figures of every memory tag on every device in use (one
/// entry per tag and device, in the order made) into `out` (`cap`
/// entries) and their number into `*count` (`out` NULL and `cap` 0 to
/// learn it). Too small an array gets the first `cap` entries.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (`count` NULL, `out` NULL with `cap`
/// above 0), `CUMEM_STATUS_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `out` must be NULL or valid for writes of `cap` entries; `count` NULL
/// (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_tag_usage(out: *mut CumemTagUsage, cap: usize, count: *mut usize) -> CumemStatus {
    guard(|| {
        if count.is_null() {
            return Err(Failure::null("count"));
        }
        if out.is_null() && cap > 0 {
            return Err(Failure::null("out"));
        }
        let all = manager()?.tag_usage();
        // SAFETY: non-null, and the caller's promise about `count`.
        unsafe { put(count, "count", all.len()) }?;
        for (i, u) in all.iter().take(cap).enumerate() {
            let entry = CumemTagUsage::of(u)?;
            // SAFETY: `out` is valid for `cap` entries (promised); `i < cap`.
            unsafe { out.add(i).write(entry) };
        }
        if all.len() > cap {
            return Err(Failure::new(
                CumemStatus::BufferTooSmall,
                format!("there are {} tag entries; the array holds {cap}", all.len()),
            ));
        }
        Ok(())
    })
}
