//! Host virtual memory: the fallback's stand-in for CUDA's VMM calls.
//!
//! | CUDA                    | here                                       |
//! | ----------------------- | ------------------------------------------ |
//! | `cuMemAddressReserve`   | `mmap(PROT_NONE, MAP_NORESERVE)` (+ hint)  |
//! | `cuMemCreate`+`cuMemMap`| `mprotect(PROT_READ \| PROT_WRITE)`        |
//! | unmap + map elsewhere   | `mremap(MREMAP_MAYMOVE \| MREMAP_FIXED)`   |
//! | `cuMemUnmap`+`Release`  | `madvise(MADV_DONTNEED)` + `PROT_NONE`     |
//! | `cuMemAddressFree`      | `munmap`                                   |
//!
//! Moving committed pages with `mremap` re-points page tables; no byte is
//! copied, just as remapping physical chunks on the GPU copies nothing.

use crate::error::{Error, Result};

fn os_err(call: &'static str) -> Error {
    Error::Os { call, source: std::io::Error::last_os_error() }
}

/// The host page size (`sysconf(_SC_PAGESIZE)`), 4096 if unknown.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096)
}

/// Reserved host address space (`mmap(PROT_NONE)`; `munmap` on drop).
#[derive(Debug)]
pub(crate) struct HostRange {
    addr: usize,
    size: usize,
    /// Spans (offset, size) whose pages [`move_to`](Self::move_to) moved
    /// away. They are holes another thread's `mmap` may fill, so the drop
    /// must not unmap them.
    moved_out: Vec<(usize, usize)>,
}

impl HostRange {
    /// Reserves `size` bytes (a multiple of the page size), preferably at
    /// `hint` (0 for none). The kernel may place it elsewhere.
    pub(crate) fn reserve(size: usize, hint: usize) -> Result<Self> {
        if size == 0 {
            return Err(Error::InvalidSize { size, reason: "an address range can't be empty" });
        }
        crate::fault::check(crate::fault::Point::Reserve)?;
        // SAFETY: without MAP_FIXED the hint only guides the kernel, which
        // never replaces an existing mapping; a fresh PROT_NONE anonymous
        // mapping aliases nothing.
        let ptr = unsafe {
            libc::mmap(
                hint as *mut libc::c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_err("mmap"));
        }
        Ok(HostRange { addr: ptr as usize, size, moved_out: Vec::new() })
    }

    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    fn span(&self, offset: usize, size: usize) -> Result<*mut libc::c_void> {
        match offset.checked_add(size) {
            Some(end) if size > 0 && end <= self.size => Ok((self.addr + offset) as *mut libc::c_void),
            _ => Err(Error::InvalidState(format!(
                "{size} B at offset {offset} does not fit in the {} B host range at {:#x}",
                self.size, self.addr
            ))),
        }
    }

    /// Makes `size` bytes at `offset` readable and writable (`mprotect`).
    /// The fault points of the three driver calls it stands for
    /// (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) are passed in that
    /// order; a failure at the last undoes the commit, as the CUDA path
    /// unmaps.
    pub(crate) fn commit(&self, offset: usize, size: usize) -> Result<()> {
        use crate::fault::{check, Point};
        let ptr = self.span(offset, size)?;
        check(Point::Create)?;
        check(Point::Map)?;
        // SAFETY: the span lies inside this reservation, which no Rust
        // reference points into; making it accessible breaks nothing.
        if unsafe { libc::mprotect(ptr, size, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
            return Err(os_err("mprotect"));
        }
        if let Err(e) = check(Point::SetAccess) {
            let _ = self.decommit(offset, size);
            return Err(e);
        }
        Ok(())
    }

    /// Gives the pages back (`madvise(MADV_DONTNEED)`) and makes the span
    /// inaccessible again (`mprotect(PROT_NONE)`).
    pub(crate) fn decommit(&self, offset: usize, size: usize) -> Result<()> {
        let ptr = self.span(offset, size)?;
        // SAFETY: the span lies inside this reservation; its owner no
        // longer uses the bytes (it asked to decommit them) and no Rust
        // reference points into it.
        if unsafe { libc::madvise(ptr, size, libc::MADV_DONTNEED) } != 0 {
            return Err(os_err("madvise"));
        }
        // SAFETY: as above.
        if unsafe { libc::mprotect(ptr, size, libc::PROT_NONE) } != 0 {
            return Err(os_err("mprotect"));
        }
        Ok(())
    }

    /// Moves the committed pages at `offset` (`size` bytes, committed by
    /// one [`commit`](Self::commit)) to `to_offset` in `to`
    /// (`mremap(MREMAP_MAYMOVE | MREMAP_FIXED)`), without copying them. The
    /// old span becomes a hole, which the drop of `self` leaves alone.
    pub(crate) fn move_to(&mut self, offset: usize, size: usize, to: &mut HostRange, to_offset: usize) -> Result<()> {
        let from = self.span(offset, size)?;
        let dest = to.span(to_offset, size)?;
        // SAFETY: both spans lie inside reservations owned by the caller;
        // MREMAP_FIXED replaces only the caller's PROT_NONE reservation at
        // `dest`, and no Rust reference points into either span.
        let moved = unsafe { libc::mremap(from, size, size, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, dest) };
        if moved == libc::MAP_FAILED {
            return Err(os_err("mremap"));
        }
        self.moved_out.push((offset, size));
        // Pages moved back into a hole fill it again.
        to.moved_out.retain(|&span| span != (to_offset, size));
        if moved != dest {
            return Err(Error::InvalidState(format!("mremap moved pages to {moved:p}, not {dest:p}")));
        }
        Ok(())
    }
}

impl Drop for HostRange {
    fn drop(&mut self) {
        self.moved_out.sort_unstable();
        let mut start = 0;
        let mut spans = Vec::with_capacity(self.moved_out.len() + 1);
        for &(offset, size) in &self.moved_out {
            if offset > start {
                spans.push((start, offset - start));
            }
            start = start.max(offset + size);
        }
        if start < self.size {
            spans.push((start, self.size - start));
        }
        for (offset, size) in spans {
            let ptr = (self.addr + offset) as *mut libc::c_void;
            // SAFETY: this struct reserved the span and still owns it (holes
            // left by moved pages are skipped); it is unmapped once.
            if unsafe { libc::munmap(ptr, size) } != 0 {
                let e = std::io::Error::last_os_error();
                eprintln!("cumem: munmap of {ptr:p}+{size} failed: {e}");
            }
        }
    }
}
