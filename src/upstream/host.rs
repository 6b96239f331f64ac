//! Host memory from the operating system: the fallback upstream.

use super::{Chunk, Upstream};
use crate::error::{Error, Result};

/// Memory from `mmap`: readable and writable, but no page is touched (or
/// committed) until it is used, so a pool can reserve gigabytes on a small
/// machine. The fallback when no CUDA driver or device is present; it
/// stands in for pinned and for device memory alike.
///
/// # Examples
/// See [`Upstream`](super::Upstream) and [`Pool`](crate::pool::Pool).
#[derive(Debug, Default, Clone, Copy)]
pub struct Host {
    _private: (),
}

impl Host {
    /// A host upstream.
    pub fn new() -> Self {
        Host { _private: () }
    }
}

/// The page size chunks are rounded to.
const PAGE: usize = 4096;

impl Upstream for Host {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        if size == 0 {
            return Err(Error::InvalidSize { size, reason: "a chunk can't be empty" });
        }
        let len = size
            .checked_next_multiple_of(PAGE)
            .ok_or(Error::InvalidSize { size, reason: "larger than the address space" })?;
        // An injected failure stands for the host running out of memory.
        let injected = crate::fault::check_driver(crate::fault::Point::HostAlloc).is_err();
        let ptr = if injected {
            libc::MAP_FAILED
        } else {
            // SAFETY: an anonymous private mapping where the kernel chooses
            // aliases nothing; the arguments are valid for mmap.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            }
        };
        if ptr == libc::MAP_FAILED {
            let source = if injected {
                std::io::Error::from_raw_os_error(libc::ENOMEM)
            } else {
                std::io::Error::last_os_error()
            };
            if source.raw_os_error() == Some(libc::ENOMEM) {
                return Err(Error::OutOfMemory {
                    pool: crate::error::PoolKind::Standalone,
                    requested: size,
                    state: Box::new(crate::error::OomState {
                        upstream: Some(format!("mmap of {len} B: {source}")),
                        ..Default::default()
                    }),
                });
            }
            return Err(Error::Os { call: "mmap", source });
        }
        Ok(Chunk { addr: ptr as usize, size: len })
    }

    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        // SAFETY: the pool returns only chunks this upstream mapped, whole,
        // once no block in them is in use; unmapping them invalidates no
        // live reference the pool handed out.
        let rc = unsafe { libc::munmap(chunk.addr as *mut libc::c_void, chunk.size) };
        if rc != 0 {
            return Err(Error::Os { call: "munmap", source: std::io::Error::last_os_error() });
        }
        Ok(())
    }

    fn granularity(&self) -> usize {
        PAGE
    }

    fn name(&self) -> &'static str {
        "host mmap (fallback)"
    }

    fn host_accessible(&self) -> bool {
        true
    }
}
