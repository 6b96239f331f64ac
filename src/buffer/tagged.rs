//! A memory tag as a value ([`MemoryTag`]): what a thread's tag scope does
//! for one allocation, for code that hands an allocator around (a model's
//! loader, a cache's constructor) instead of setting the thread's tag.

use std::sync::Arc;

use super::DeviceBuffer;
use crate::cuda::Stream;
use crate::device::{check_tag_name, TagScope};
use crate::error::Result;
use crate::manager::MemoryManager;

/// A memory tag (see `MemoryManager::tag`): device memory allocated through
/// it goes to the tag's pool, whatever tag the calling thread has set, and
/// sleeps and wakes with the tag.
///
/// # Examples
/// ```
/// use cumem::{MemoryManager, MemoryTag};
/// let mm = MemoryManager::global()?;
/// let weights = MemoryTag::new("doc-weights")?;
/// let w = weights.buffer::<f32>(1024)?; // a DeviceBuffer in the tag
/// let raw = weights.allocate(mm, 4096)?; // raw device memory in the tag
/// assert!(mm.tag_usage().iter().any(|u| u.name == "doc-weights" && u.pool.live_blocks == 2));
/// mm.free_device(raw)?;
/// drop(w);
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemoryTag {
    name: Arc<str>,
}

impl MemoryTag {
    /// The tag `name` (checked as `MemoryManager::tag` checks it).
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) for a bad name.
    pub fn new(name: &str) -> Result<MemoryTag> {
        check_tag_name(name)?;
        Ok(MemoryTag { name: Arc::from(name) })
    }

    /// The tag's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets this tag on the calling thread until the scope is dropped.
    pub fn scope(&self) -> TagScope {
        TagScope::enter(&self.name).expect("the name was checked when the tag was made")
    }

    /// `size` bytes of device memory in this tag on `mm`'s default device
    /// ([`MemoryManager::allocate_device`]).
    ///
    /// # Errors
    /// As `allocate_device`; [`Error::Tag`](crate::Error::Tag) while asleep.
    pub fn allocate(&self, mm: &MemoryManager, size: usize) -> Result<u64> {
        let _tag = self.scope();
        mm.allocate_device(size)
    }

    /// `size` bytes in this tag for work on `stream`
    /// ([`MemoryManager::allocate_device_on`]).
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate).
    pub fn allocate_on(&self, mm: &MemoryManager, size: usize, stream: &Stream) -> Result<u64> {
        let _tag = self.scope();
        mm.allocate_device_on(size, stream)
    }

    /// A [`DeviceBuffer`] of `len` values in this tag (the global manager's
    /// default device, [`DeviceBuffer::new`]).
    ///
    /// # Errors
    /// As [`DeviceBuffer::new`]; [`Error::Tag`](crate::Error::Tag) asleep.
    pub fn buffer<T: Copy>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let _tag = self.scope();
        DeviceBuffer::new(len)
    }

    /// [`DeviceBuffer::new_on`] in this tag: `len` values for work on `stream`.
    ///
    /// # Errors
    /// As [`buffer`](Self::buffer).
    pub fn buffer_on<T: Copy>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let _tag = self.scope();
        DeviceBuffer::new_on(len, stream)
    }
}
