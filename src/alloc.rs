//! [`PinnedAlloc`]: the pinned pool as an `Allocator` for collections.

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::AllocError;
#[cfg(doc)]
use allocator_api2::alloc::Allocator;

use crate::manager::MemoryManager;
use crate::pool::{Pool, MAX_ALIGN};
use crate::upstream::Upstream;

/// A handle to the global manager's pinned pool that implements
/// [`Allocator`] (allocator-api2 0.2, the version hashbrown uses), so that
/// `allocator_api2::vec::Vec<T, PinnedAlloc>`, `Box<T, PinnedAlloc>` and
/// `hashbrown::HashMap<K, V, S, PinnedAlloc>` keep their data in pinned
/// host memory, ready for fast DMA copies.
///
/// `grow` and `shrink` resize in place when the block after the allocation
/// is free, and otherwise allocate, copy and free.
///
/// # Errors, not aborts
/// Every refusal (out of pinned memory, an alignment over 2 MiB, an
/// absurd size, the manager shut down or not configurable) is an
/// [`AllocError`]; [`PinnedAlloc::last_error`] then says why. What a
/// collection does with an `AllocError` is its own rule: the infallible
/// methods (`push`, `with_capacity_in`, `reserve`, `resize`, `Box::new_in`)
/// abort the process through `handle_alloc_error`, as every Rust
/// collection does. Where a refusal is possible, use the fallible forms
/// (`try_reserve`, `try_reserve_exact`, `Box::try_new_in`), which return
/// the error instead. cumem's own code never grows a pinned collection
/// infallibly.
///
/// # Examples
/// ```
/// use cumem::{PinnedAlloc, PinnedVec};
/// let mut v: PinnedVec<f32> = PinnedVec::new_in(PinnedAlloc);
/// v.extend((0..1000).map(|i| i as f32));
/// assert_eq!(v[999], 999.0);
/// assert_eq!(v.as_ptr() as usize % 256, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedAlloc;

/// A `Vec` in pinned host memory.
///
/// # Examples
/// See [`PinnedAlloc`].
pub type PinnedVec<T> = allocator_api2::vec::Vec<T, PinnedAlloc>;

/// A `Box` in pinned host memory.
///
/// # Examples
/// ```
/// use cumem::{PinnedAlloc, PinnedBox};
/// let b: PinnedBox<[u8; 4096]> = PinnedBox::new_in([0; 4096], PinnedAlloc);
/// assert_eq!(b.as_ptr() as usize % 256, 0);
/// ```
pub type PinnedBox<T> = allocator_api2::boxed::Box<T, PinnedAlloc>;

thread_local! {
    /// Why this thread's last `PinnedAlloc` request was refused.
    static LAST_ERROR: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Records a refusal for [`PinnedAlloc::last_error`]; returns [`AllocError`].
fn refused(why: impl std::fmt::Display) -> AllocError {
    let text = why.to_string();
    // A thread being torn down has no slot left: nothing to record then.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = Some(text));
    AllocError
}

impl PinnedAlloc {
    /// Why this thread's most recent refused request (of `PinnedAlloc` or
    /// [`ManagedAlloc`](crate::ManagedAlloc)) was refused (the
    /// [`Error`](crate::Error)'s message), or `None` if none was. An
    /// [`AllocError`] carries no reason; this does.
    ///
    /// # Examples
    /// ```
    /// use cumem::{PinnedAlloc, PinnedVec};
    /// let mut v: PinnedVec<u8> = PinnedVec::new_in(PinnedAlloc);
    /// assert!(v.try_reserve(usize::MAX / 2).is_err()); // an error, no abort
    /// assert!(PinnedAlloc::last_error().is_some());
    /// ```
    pub fn last_error() -> Option<String> {
        LAST_ERROR.try_with(|e| e.borrow().clone()).ok().flatten()
    }
}

/// The pool side of an [`Allocator`] over host-accessible blocks (pinned
/// or managed memory): [`PinnedAlloc`] and
/// [`ManagedAlloc`](crate::ManagedAlloc) share the allocator logic below
/// and differ only in the pool they name.
pub(crate) trait HostBlocks {
    /// Allocates a block of at least `size` bytes aligned to `align`.
    fn allocate_block(&self, size: usize, align: usize) -> crate::error::Result<crate::pool::Allocation>;
    /// Frees the block at `addr`.
    fn free_block(&self, addr: usize) -> crate::error::Result<()>;
    /// The pool the blocks come from.
    fn pool(&self) -> crate::error::Result<&'static Pool<Box<dyn Upstream>>>;
    /// Grows the live block at `addr` to `size` bytes in place; its new size.
    fn grow_in_place(&self, addr: usize, size: usize) -> crate::error::Result<Option<usize>> {
        let pool = self.pool()?;
        Ok(pool.grow_in_place(addr, size).then(|| pool.block_size(addr).unwrap_or(size)))
    }
    /// Shrinks the live block at `addr` to `size` bytes in place; its new size.
    fn shrink_in_place(&self, addr: usize, size: usize) -> crate::error::Result<Option<usize>> {
        let pool = self.pool()?;
        Ok(pool.shrink_in_place(addr, size).then(|| pool.block_size(addr).unwrap_or(size)))
    }
    /// The allocator's name, for messages.
    fn name(&self) -> &'static str;
}

impl HostBlocks for PinnedAlloc {
    fn allocate_block(&self, size: usize, align: usize) -> crate::error::Result<crate::pool::Allocation> {
        MemoryManager::global()?.allocate_pinned_block(size, align)
    }

    fn free_block(&self, addr: usize) -> crate::error::Result<()> {
        MemoryManager::global()?.free_pinned(addr as *mut u8)
    }

    fn pool(&self) -> crate::error::Result<&'static Pool<Box<dyn Upstream>>> {
        Ok(MemoryManager::global()?.pinned_pool())
    }

    fn name(&self) -> &'static str {
        "PinnedAlloc"
    }
}

fn dangling(layout: Layout) -> NonNull<[u8]> {
    // A zero-size allocation needs a non-null, aligned pointer and nothing
    // behind it: the alignment itself is such an address.
    let ptr = NonNull::new(layout.align() as *mut u8).expect("alignments are non-zero");
    NonNull::slice_from_raw_parts(ptr, 0)
}

/// [`Allocator::allocate`] over `blocks`.
pub(crate) fn allocate(blocks: &impl HostBlocks, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
    if layout.size() == 0 {
        return Ok(dangling(layout));
    }
    if layout.align() > MAX_ALIGN {
        return Err(refused(crate::error::Error::InvalidAlignment { align: layout.align(), max: MAX_ALIGN }));
    }
    let a = blocks.allocate_block(layout.size(), layout.align()).map_err(refused)?;
    let ptr = NonNull::new(a.addr as *mut u8).ok_or_else(|| refused("the pool returned address 0"))?;
    Ok(NonNull::slice_from_raw_parts(ptr, a.size))
}

/// [`Allocator::deallocate`] over `blocks`.
pub(crate) fn deallocate(blocks: &impl HostBlocks, ptr: NonNull<u8>, layout: Layout) {
    if layout.size() == 0 {
        return;
    }
    if let Err(e) = blocks.free_block(ptr.as_ptr() as usize) {
        // A deallocate can't fail; a bad pointer here is a bug in the
        // caller. Say so, and keep the pool intact.
        eprintln!("cumem: {}::deallocate: {e}", blocks.name());
    }
}

/// [`Allocator::shrink`] over `blocks`.
///
/// # Safety
/// `ptr` is a live allocation of `blocks` with layout `old`, and
/// `new.size() <= old.size()`.
pub(crate) unsafe fn shrink(
    blocks: &impl HostBlocks,
    ptr: NonNull<u8>,
    old: Layout,
    new: Layout,
) -> Result<NonNull<[u8]>, AllocError> {
    debug_assert!(new.size() <= old.size());
    if new.size() == 0 {
        deallocate(blocks, ptr, old);
        return Ok(dangling(new));
    }
    if old.size() != 0 && new.align() <= old.align().max(crate::upstream::BLOCK_ALIGN) {
        if let Some(size) = blocks.shrink_in_place(ptr.as_ptr() as usize, new.size()).map_err(refused)? {
            return Ok(NonNull::slice_from_raw_parts(ptr, size));
        }
    }
    // SAFETY: the caller's contract is what `resize` needs.
    unsafe { resize(blocks, ptr, old, new, false) }
}

/// Resizes in place when possible, else allocates `new`, copies the
/// common prefix and frees the old block (`grow`, `grow_zeroed` and the
/// slow path of `shrink`).
///
/// # Safety
/// `ptr` is a live allocation of `blocks` with layout `old`.
pub(crate) unsafe fn resize(
    blocks: &impl HostBlocks,
    ptr: NonNull<u8>,
    old: Layout,
    new: Layout,
    zero_tail: bool,
) -> Result<NonNull<[u8]>, AllocError> {
    let addr = ptr.as_ptr() as usize;
    if old.size() != 0 && addr % new.align() == 0 {
        if let Some(size) = blocks.grow_in_place(addr, new.size()).map_err(refused)? {
            if zero_tail && new.size() > old.size() {
                // SAFETY: the block now spans at least `new.size()` bytes
                // from `ptr`, all owned by this allocation.
                unsafe { ptr.as_ptr().add(old.size()).write_bytes(0, new.size() - old.size()) };
            }
            return Ok(NonNull::slice_from_raw_parts(ptr, size));
        }
    }
    let fresh = allocate(blocks, new)?;
    if zero_tail {
        // SAFETY: `fresh` is a live block of at least `new.size()` bytes.
        unsafe { fresh.as_ptr().cast::<u8>().write_bytes(0, new.size()) };
    }
    let keep = old.size().min(new.size());
    // SAFETY: `ptr` holds `old.size()` bytes owned by the caller, `fresh` at
    // least `new.size()`; distinct live blocks don't overlap.
    unsafe { std::ptr::copy_nonoverlapping(ptr.as_ptr(), fresh.as_ptr().cast::<u8>(), keep) };
    deallocate(blocks, ptr, old);
    Ok(fresh)
}

/// Implements [`Allocator`] for a [`HostBlocks`] type by the functions
/// above: allocator-api2 0.2's (the version hashbrown uses) and, with the
/// feature `allocator-api2-04`, 0.4's, so collections of either line use
/// the same pool.
macro_rules! host_allocator {
    ($alloc:ty) => {
        $crate::alloc::host_allocator!($alloc, allocator_api2);
        #[cfg(feature = "allocator-api2-04")]
        $crate::alloc::host_allocator!($alloc, allocator_api2_04);
    };
    ($alloc:ty, $api:ident) => {
        const _: () = {
            use std::alloc::Layout;
            use std::ptr::NonNull;

            use $api::alloc::{AllocError, Allocator};

            type AllocResult = Result<NonNull<[u8]>, AllocError>;

            // SAFETY: blocks come from one of the manager's pools of
            // host-accessible memory (pinned or managed), which hands each
            // address range to one owner until it is freed, aligned to at
            // least the layout's alignment (checked ≤ MAX_ALIGN) and at least
            // `layout.size()` long; the slice returned is the block's real
            // size, all of it reserved for this allocation. Every value of
            // the type names the same pool, so memory from one may be freed
            // through another. (The 0.4 trait has the same methods,
            // arguments and guarantees; only the error type differs.)
            unsafe impl Allocator for $alloc {
                fn allocate(&self, layout: Layout) -> AllocResult {
                    $crate::alloc::allocate(self, layout).map_err(|_| AllocError)
                }

                unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
                    $crate::alloc::deallocate(self, ptr, layout)
                }

                unsafe fn grow(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> AllocResult {
                    // SAFETY: the caller's contract for `grow` is what `resize` needs.
                    unsafe { $crate::alloc::resize(self, ptr, old, new, false) }.map_err(|_| AllocError)
                }

                unsafe fn grow_zeroed(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> AllocResult {
                    // SAFETY: as in `grow`.
                    unsafe { $crate::alloc::resize(self, ptr, old, new, true) }.map_err(|_| AllocError)
                }

                unsafe fn shrink(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> AllocResult {
                    // SAFETY: the caller's contract for `shrink` is what `shrink` needs.
                    unsafe { $crate::alloc::shrink(self, ptr, old, new) }.map_err(|_| AllocError)
                }
            }
        };
    };
}
pub(crate) use host_allocator;

host_allocator!(PinnedAlloc);
