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
