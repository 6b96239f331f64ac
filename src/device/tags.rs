//! Memory tags: device memory allocated under a name the program chooses
//! ("weights", "kv_cache"), kept apart so that it can sleep (give its
//! physical pages back) and wake (get new pages at the same addresses).
//!
//! # Implementation details
//!
//! - **The thread's tag.** A thread sets a tag ([`TagScope`], made by
//!   `MemoryManager::tag`); while it is set, every device allocation of the
//!   thread that is not routed into a graph-private pool (a capture's
//!   allocations belong to its graph) goes to the tag's pool on the
//!   allocation's device. The check on the untagged path is one read of a
//!   thread-local flag.
//! - **One pool per tag and device.** A [`TagPool`] is a best-fit pool of
//!   its own over CUDA virtual memory (the host fallback's reserved address
//!   space), remapping pages like the sync pool, with no thread
//!   cache: its address space is the tag's alone,
//!   so sleep can unmap every page of it and wake can map pages at the same
//!   addresses. Frees find the pool by address after the sync pool did
//!   not know the pointer.
//! - **States.** Awake → Sleeping → Asleep → Waking → Awake. An allocation
//!   counts itself in (`inflight`) and then reads the state; sleep moves
//!   the state to Sleeping and then waits until no allocation is in flight
//!   (each write followed by a sequentially consistent fence before the
//!   read, so either the allocation sees Sleeping and backs out, or sleep
//!   sees it in flight and waits for it). Only an Awake pool allocates;
//!   frees work in every state (a freed block is not copied back).
//! - What sleep copies, where, and when the device is synchronised is the
//!   manager's part (`manager/sleep/`); this file moves the states, and
//!   the pool the pages ([`Pool::unmap_all`], [`Pool::map_ranges`]).

use std::cell::RefCell;
use std::sync::Arc as StdArc;

use crate::error::{Error, Result};
use crate::pool::{Pool, PoolStats};
use crate::sync::{backoff, fence, lock, Arc, AtomicU8, AtomicUsize, Mutex, Ordering};
use crate::upstream::Upstream;

/// The longest tag name accepted.
pub const MAX_TAG_LEN: usize = 128;

/// Where a tag's memory is on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TagState {
    /// Mapped and usable: allocations are served.
    Awake,
    /// Being put to sleep (contents being copied out).
    Sleeping,
    /// Its pages are given back; its addresses stay reserved.
    Asleep,
    /// Getting pages again (contents being copied back).
    Waking,
}

impl TagState {
    fn from_u8(v: u8) -> TagState {
        match v {
            AWAKE => TagState::Awake,
            SLEEPING => TagState::Sleeping,
            ASLEEP => TagState::Asleep,
            _ => TagState::Waking,
        }
    }

    /// A lower-case name ("awake", "asleep", ...).
    pub fn name(self) -> &'static str {
        match self {
            TagState::Awake => "awake",
            TagState::Sleeping => "sleeping",
            TagState::Asleep => "asleep",
            TagState::Waking => "waking",
        }
    }
}

impl std::fmt::Display for TagState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

const AWAKE: u8 = 0;
const SLEEPING: u8 = 1;
const ASLEEP: u8 = 2;
const WAKING: u8 = 3;

std::thread_local! {
    /// The tag of this thread's device allocations (`None`: untagged).
    static CURRENT: RefCell<Option<StdArc<str>>> = const { RefCell::new(None) };
}

/// The tag set on this thread, if any.
pub fn current_tag() -> Option<StdArc<str>> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Whether a tag is set on this thread (the allocation path's check).
#[inline]
pub(crate) fn tagged() -> bool {
    CURRENT.with(|c| c.borrow().is_some())
}

/// Checks a tag name: 1 to [`MAX_TAG_LEN`] bytes, no NUL.
///
/// # Errors
/// [`Error::Config`] naming what is wrong.
pub fn check_tag_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_TAG_LEN || name.contains('\0') {
        return Err(Error::Config(format!(
            "a memory tag's name must be 1 to {MAX_TAG_LEN} bytes with no NUL (got {:?})",
            name.chars().take(40).collect::<String>()
        )));
    }
    Ok(())
}

/// Sets this thread's tag until the scope is dropped, when the tag that
/// was set before comes back (scopes nest). Made by
/// `MemoryManager::tag`; it stays on the thread that made it.
#[derive(Debug)]
#[must_use = "the tag is set only while the scope lives"]
pub struct TagScope {
    previous: Option<StdArc<str>>,
    /// Not `Send`: the scope sets and restores this thread's tag.
    _thread: std::marker::PhantomData<*const ()>,
}

impl TagScope {
    /// Sets `name` (checked) as this thread's tag.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad name.
    pub fn enter(name: &str) -> Result<TagScope> {
        check_tag_name(name)?;
        let previous = CURRENT.with(|c| c.borrow_mut().replace(StdArc::from(name)));
        Ok(TagScope { previous, _thread: std::marker::PhantomData })
    }

    /// Clears this thread's tag until the scope is dropped.
    pub fn untagged() -> TagScope {
        let previous = CURRENT.with(|c| c.borrow_mut().take());
        TagScope { previous, _thread: std::marker::PhantomData }
    }
}

impl Drop for TagScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// Sets (`Some`) or clears (`None`) this thread's tag with no scope, for
/// callers that can't hold one (the C ABI); returns the tag set before.
///
/// # Errors
/// [`Error::Config`] for a bad name.
pub fn set_thread_tag(name: Option<&str>) -> Result<Option<StdArc<str>>> {
    if let Some(n) = name {
        check_tag_name(n)?;
    }
    Ok(CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), name.map(StdArc::from))))
}

/// What one tag holds on one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagUsage {
    /// The tag.
    pub name: String,
    /// The device.
    pub device: usize,
    /// Where its memory is.
    pub state: TagState,
    /// The pool's figures: live blocks and bytes (`in_use`, `requested`),
    /// physical memory mapped (`mapped`, 0 while asleep), address space
    /// (`reserved`).
    pub pool: PoolStats,
    /// Bytes of its live blocks' contents held in pinned host memory while
    /// it sleeps (filled in by `MemoryManager::tag_usage`; 0 otherwise).
    pub offloaded: usize,
}

/// A shared handle to a tag's pool.
pub(crate) type TagPoolRef = Arc<TagPool>;

/// The pool of one tag on one device: its pool and the state machine of
/// sleep and wake (the manager drives it; public for the loom models and
/// for programs that build a tag's pool over an upstream of their own).
pub struct TagPool {
    pub(crate) name: StdArc<str>,
    /// The tag's pool (remapping pages).
    pub pool: Pool<Box<dyn Upstream>>,
    state: AtomicU8,
    /// Allocations under way (see the module docs).
    inflight: AtomicUsize,
}

impl std::fmt::Debug for TagPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TagPool").field("name", &self.name).field("state", &self.state()).finish()
    }
}

/// An allocation counted in (the pool was awake); sleep waits for its drop.
#[derive(Debug)]
pub struct Entered<'a>(&'a TagPool);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TagPool {
    /// An awake pool of tag `name` over `pool`.
    pub fn new(name: &str, pool: Pool<Box<dyn Upstream>>) -> Self {
        TagPool { name: StdArc::from(name), pool, state: AtomicU8::new(AWAKE), inflight: AtomicUsize::new(0) }
    }

    /// The tag's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the pool's memory is.
    pub fn state(&self) -> TagState {
        TagState::from_u8(self.state.load(Ordering::SeqCst))
    }

    /// Counts an allocation in while the pool is awake.
    ///
    /// # Errors
    /// [`Error::Tag`] when it is not awake.
    pub fn enter(&self) -> Result<Entered<'_>> {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        // Pairs with `begin_sleep`'s fence: one thread sees the other's write.
        fence(Ordering::SeqCst);
        let entered = Entered(self);
        match self.state.load(Ordering::SeqCst) {
            AWAKE => Ok(entered),
            s => Err(Error::Tag {
                tag: self.name.to_string(),
                why: format!("its memory is {}: allocations in it are refused until wake()", TagState::from_u8(s)),
            }),
        }
    }

    /// Awake → Sleeping, then waits for the allocations under way.
    ///
    /// # Errors
    /// [`Error::Tag`] when the pool is not awake (sleeping twice).
    pub fn begin_sleep(&self) -> Result<()> {
        self.transition(AWAKE, SLEEPING, "put to sleep")?;
        // Pairs with the fence in `enter`.
        fence(Ordering::SeqCst);
        let mut attempt = 0;
        while self.inflight.load(Ordering::SeqCst) != 0 {
            backoff(attempt);
            attempt = attempt.saturating_add(1);
        }
        Ok(())
    }

    /// Asleep → Waking.
    ///
    /// # Errors
    /// [`Error::Tag`] when it is not asleep (waking a tag that is awake).
    pub fn begin_wake(&self) -> Result<()> {
        self.transition(ASLEEP, WAKING, "woken")
    }

    /// Ends a sleep (`Sleeping → Asleep`) or undoes one (`→ Awake`).
    pub fn end_sleep(&self, slept: bool) {
        self.state.store(if slept { ASLEEP } else { AWAKE }, Ordering::SeqCst);
    }

    /// Ends a wake (`Waking → Awake`) or undoes one (`→ Asleep`).
    pub fn end_wake(&self, woke: bool) {
        self.state.store(if woke { AWAKE } else { ASLEEP }, Ordering::SeqCst);
    }

    fn transition(&self, from: u8, to: u8, what: &str) -> Result<()> {
        self.state.compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst).map(|_| ()).map_err(|now| {
            Error::Tag {
                tag: self.name.to_string(),
                why: format!(
                    "it can't be {what}: its memory is {} (it must be {})",
                    TagState::from_u8(now),
                    TagState::from_u8(from)
                ),
            }
        })
    }

    pub(crate) fn usage(&self, device: usize) -> TagUsage {
        TagUsage { name: self.name.to_string(), device, state: self.state(), pool: self.pool.stats(), offloaded: 0 }
    }
}

/// Makes a tag's pool (over CUDA VMM or the host fallback's address space).
pub(crate) type TagPoolFactory = Box<dyn Fn() -> Result<Pool<Box<dyn Upstream>>> + Send + Sync>;

/// The tag pools of one device.
pub(crate) struct TagPools {
    pools: Mutex<Vec<Arc<TagPool>>>,
    /// How many pools exist: frees of unknown pointers skip the lock at 0.
    count: AtomicUsize,
    make: Option<TagPoolFactory>,
}

impl std::fmt::Debug for TagPools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TagPools").field("count", &self.count.load(Ordering::Relaxed)).finish()
    }
}

impl TagPools {
    pub(crate) fn new(make: Option<TagPoolFactory>) -> Self {
        TagPools { pools: Mutex::new(Vec::new()), count: AtomicUsize::new(0), make }
    }

    /// The pool of `name`, made on first use (with no lock held).
    ///
    /// # Errors
    /// [`Error::Tag`] when this device can't remap pages; the pool's errors.
    pub(crate) fn pool(&self, name: &StdArc<str>) -> Result<Arc<TagPool>> {
        if let Some(a) = self.find(name) {
            return Ok(a);
        }
        let make = self.make.as_ref().ok_or_else(|| Error::Tag {
            tag: name.to_string(),
            why: "this device allocator has no tag pools".into(),
        })?;
        let pool = make()?;
        if !pool.remaps() {
            return Err(Error::Tag {
                tag: name.to_string(),
                why: "the device can't map memory page by page (CUDA virtual memory management), which tags need \
                      to sleep"
                    .into(),
            });
        }
        let mut pools = lock(&self.pools);
        if let Some(a) = pools.iter().find(|a| a.name == *name) {
            // Another thread made it meanwhile; ours was never used.
            return Ok(a.clone());
        }
        let a = Arc::new(TagPool::new(name, pool));
        pools.push(a.clone());
        self.count.store(pools.len(), Ordering::Release);
        Ok(a)
    }

    /// The pool of `name`, if it was made.
    pub(crate) fn find(&self, name: &str) -> Option<Arc<TagPool>> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        lock(&self.pools).iter().find(|a| &*a.name == name).cloned()
    }

    /// Every pool, in the order they were made.
    pub(crate) fn all(&self) -> Vec<Arc<TagPool>> {
        if self.count.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        lock(&self.pools).clone()
    }

    /// The pool whose address space holds `addr`.
    pub(crate) fn owner(&self, addr: usize) -> Option<Arc<TagPool>> {
        self.all().into_iter().find(|a| a.pool.contains(addr))
    }
}
