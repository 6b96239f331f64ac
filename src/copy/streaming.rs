//! The host memcpy into the staging ring, for copies to the device.
//!
//! A device reads host memory slowly when the lines it reads sit modified
//! in a core's cache: every line costs a snoop. A chunk copied into the
//! ring with ordinary stores is in just that state when its DMA starts a
//! few microseconds later: the DMAs of an 8 MiB copy ran at about 30 GB/s
//! against 52 from pinned memory written long before (and a busy memcpy
//! elsewhere did not slow a DMA down). Stores that bypass the caches
//! (`movntdq` on x86-64) put the chunk in memory instead, where the DMA
//! reads it at full rate; other targets fall back to a plain copy.

/// Copies `len` bytes from `src` to `dst`, the stores bypassing the
/// caches where the CPU can, and makes them visible to other threads and
/// devices before it returns.
///
/// # Safety
/// `src` is valid for `len` reads, `dst` for `len` writes; no overlap.
pub(super) unsafe fn copy_to_ring(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract.
    unsafe {
        x86::copy(src, dst, len);
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// Bytes per round: a cache line, so write-combining sends whole lines.
    const LINE: usize = 64;

    /// # Safety
    /// As [`super::copy_to_ring`].
    pub(super) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
        // Plain stores up to the first 16-byte aligned destination byte
        // (`movntdq` needs aligned addresses), and for the tail.
        let head = dst.align_offset(16).min(len);
        let body = (len - head) / LINE * LINE;
        // SAFETY: the caller's contract covers `0 .. len` of both; the
        // body's stores are 16-byte aligned (`head` aligns `dst`), its
        // loads unaligned ones; SSE2 is part of x86-64.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (s, d) = (src.add(head), dst.add(head));
            let mut i = 0;
            while i < body {
                let (s, d) = (s.add(i).cast::<__m128i>(), d.add(i).cast::<__m128i>());
                let a = _mm_loadu_si128(s);
                let b = _mm_loadu_si128(s.add(1));
                let c = _mm_loadu_si128(s.add(2));
                let e = _mm_loadu_si128(s.add(3));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
                i += LINE;
            }
            std::ptr::copy_nonoverlapping(s.add(body), d.add(body), len - head - body);
            // Streaming stores are weakly ordered: fence them before the
            // caller publishes the piece (and a DMA reads it).
            _mm_sfence();
        }
    }
}

#[cfg(test)]
mod tests;
