//! Fast copies from and to ordinary (pageable) host memory: staged through
//! a pinned ring from the pinned pool, pipelined, the host memcpys on
//! several threads ([`MemoryManager::copy_from_pageable`],
//! [`DeviceBuffer::copy_from_pageable`] and their `_to_` twins).
//!
//! A DMA from pageable memory runs at a fraction of pinned speed (the
//! driver stages it through a small buffer of its own, one piece at a
//! time). Staging through the pool's pinned blocks with the host memcpy of
//! one chunk overlapping the DMA of the previous one gets most of the
//! pinned bandwidth without pinning the caller's memory.

mod pipeline;
mod staged;
mod streaming;
mod workers;

use crate::buffer::DeviceBuffer;
use crate::cuda::Stream;
use crate::error::{Error, Result};
use crate::manager::MemoryManager;

fn check_len(what: &str, n: usize, len: usize) -> Result<()> {
    if n == len {
        return Ok(());
    }
    Err(Error::InvalidState(format!("{what} of {n} values into or out of a device buffer of {len} values")))
}

impl<T: Copy> DeviceBuffer<T> {
    /// Copies `src`, ordinary host memory, into the buffer through pinned
    /// staging blocks (see [`MemoryManager::copy_from_pageable`]): after
    /// the work queued on `stream`, returning once the data has landed.
    /// `src.len()` must equal [`len`](Self::len).
    ///
    /// Work on other streams (including cudarc's tracked uses) is not
    /// waited for: order it before `stream` first.
    ///
    /// # Errors
    /// A length mismatch ([`Error::InvalidState`]); as
    /// [`MemoryManager::copy_from_pageable`].
    ///
    /// # Examples
    /// ```
    /// use cumem::{DeviceBuffer, Stream};
    /// let stream = Stream::new()?;
    /// let data: Vec<f32> = (0..3_000_000).map(|i| i as f32).collect();
    /// let mut buf = DeviceBuffer::<f32>::new_on(data.len(), &stream)?;
    /// buf.copy_from_pageable(&data, &stream)?;
    /// let mut back = vec![0.0; data.len()];
    /// buf.copy_to_pageable(&mut back, &stream)?;
    /// assert_eq!(back, data);
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub fn copy_from_pageable(&mut self, src: &[T], stream: &Stream) -> Result<()> {
        check_len("staged copy", src.len(), self.len())?;
        let mm = MemoryManager::global()?;
        // SAFETY: the destination is this buffer, exactly `src.len()`
        // values long and borrowed mutably for the call; it is device
        // memory of the global manager (host memory on its fallback), a
        // different allocation from `src`.
        unsafe { mm.copy_from_pageable(self.device_ptr(), src, stream) }
    }

    /// Copies the buffer into `dst`, ordinary host memory, through pinned
    /// staging blocks: after the work queued on `stream`, returning once
    /// `dst` holds the data. `dst.len()` must equal [`len`](Self::len).
    ///
    /// # Errors
    /// As [`copy_from_pageable`](Self::copy_from_pageable).
    ///
    /// # Examples
    /// See [`copy_from_pageable`](Self::copy_from_pageable).
    pub fn copy_to_pageable(&self, dst: &mut [T], stream: &Stream) -> Result<()> {
        check_len("staged copy", dst.len(), self.len())?;
        let mm = MemoryManager::global()?;
        // SAFETY: the source is this buffer, `dst.len()` values of `T`,
        // borrowed for the call (so not written through cumem); `dst` is a
        // distinct host allocation.
        unsafe { mm.copy_to_pageable(dst, self.device_ptr(), stream) }
    }
}
