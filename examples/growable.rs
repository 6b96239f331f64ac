//! A GrowableBuffer growing without copying: on the GPU when there is one
//! (CUDA virtual memory management), else on the host fallback.
//!
//! ```text
//! cargo run --release --example growable
//! ```

#[path = "../benches/common/grow.rs"]
mod grow;

use cumem::{GrowableBuffer, VmBackend};

fn main() -> cumem::Result<()> {
    let backend = VmBackend::auto();
    println!("backend: {backend}");
    if backend.is_host() {
        println!("(no usable CUDA device, or CUMEM_FORCE_HOST=1: running on the host fallback)");
    }
    let mut buf = GrowableBuffer::<u32>::with_capacity_on(backend, 1)?;
    println!("granularity {} B, first pointer {:#x}", buf.granularity(), buf.device_ptr());
    let chunk: Vec<u32> = (0..(1 << 18)).collect();
    for round in 0..8 {
        let before = buf.device_ptr();
        let path = buf.grow(((2 << 20) / 4) << round)?;
        // Fill it: the values written earlier stay where they are.
        while buf.len() < buf.capacity() {
            let n = chunk.len().min(buf.capacity() - buf.len());
            buf.extend_from_host(&chunk[..n])?;
        }
        let moved = if buf.device_ptr() == before { "pointer unchanged" } else { "pointer moved, nothing copied" };
        println!("capacity {:>4} MiB via {path:?}: {moved}", buf.capacity_bytes() >> 20);
    }
    // The other path: give back the guard after the range and take those
    // addresses, so the next growth must remap (still without copying).
    buf.set_headroom(false);
    let end = buf.device_ptr() + buf.reserved_bytes() as u64;
    let _blocker = Blocker::at(&buf.backend(), end);
    let (before, len) = (buf.device_ptr(), buf.len());
    let path = buf.grow(buf.capacity() * 2)?;
    let intact = buf.to_vec()?.chunks(chunk.len()).all(|c| c == &chunk[..c.len()]);
    println!(
        "addresses after the range taken: {path:?}, pointer {before:#x} -> {:#x}, {len} elements intact: {}",
        buf.device_ptr(),
        intact
    );

    let mut tail = vec![0u32; 4];
    buf.copy_to_host(&mut tail)?;
    assert_eq!(tail, [0, 1, 2, 3]);
    println!("stats: {:?}", buf.stats());
    buf.truncate(10);
    let released = buf.shrink_to_fit()?;
    println!("shrink_to_fit released {} MiB", released >> 20);

    let env = grow::Env::new();
    env.print_table(3);
    Ok(())
}

/// Address space taken right after a buffer's range.
enum Blocker {
    Cuda(#[allow(dead_code)] cumem::cuda::vmm::AddressRange),
    Host(*mut libc::c_void),
    None,
}

impl Blocker {
    fn at(backend: &VmBackend, end: u64) -> Blocker {
        match backend {
            VmBackend::Cuda(ordinal) => {
                let ctx = cumem::cuda::device_context(*ordinal).ok().flatten().expect("context");
                let gran = cumem::cuda::vmm::granularity(&ctx).expect("granularity").minimum;
                match cumem::cuda::vmm::AddressRange::reserve(&ctx, gran, end) {
                    Ok(r) => Blocker::Cuda(r),
                    Err(_) => Blocker::None,
                }
            }
            VmBackend::Host => {
                // SAFETY: MAP_FIXED_NOREPLACE never replaces a mapping; the
                // page is unmapped on drop.
                let p = unsafe {
                    libc::mmap(
                        end as usize as *mut libc::c_void,
                        4096,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    Blocker::None
                } else {
                    Blocker::Host(p)
                }
            }
        }
    }
}

impl Drop for Blocker {
    fn drop(&mut self) {
        if let Blocker::Host(p) = *self {
            // SAFETY: mapped in `at`, unmapped once.
            unsafe { libc::munmap(p, 4096) };
        }
    }
}
