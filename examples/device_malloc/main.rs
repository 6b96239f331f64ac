//! Kernels that `malloc` from the device heap, with the heap's size set
//! through cumem first (the CUDA Programming Guide's per-block example:
//! allocation persisting between kernel launches).
//!
//! ```text
//! cargo run --example device_malloc -- [HEAP] [PER_BLOCK]
//! ```
//!
//! `HEAP` (or `CUMEM_MALLOC_HEAP`; default `4MiB`) is the heap size to set,
//! before the kernels' module loads. Round 1 has each of the 64 blocks ask
//! for `PER_BLOCK` bytes (default: an eighth of the heap, so together eight
//! times what the heap holds): some `malloc` calls return NULL, the kernels
//! count them, and the example reports them. Round 2 asks for what the
//! blocks need (512 B each), which fits. Last, it shows that the heap can't
//! be resized once such kernels ran. On the host fallback it says it needs
//! a GPU and exits 0.

mod kernels;

use std::error::Error;

use cumem::manager::{human_bytes, parse_size};
use cumem::MemoryManager;
use kernels::{MallocKernels, BYTES_USED, NUM_BLOCKS};

fn size_arg(arg: Option<String>, name: &str) -> Result<Option<usize>, Box<dyn Error>> {
    match arg {
        None => Ok(None),
        Some(s) => match parse_size(&s) {
            Some(n) => Ok(Some(n as usize)),
            None => Err(format!("{name}: '{s}' is not a size (try 4MiB)").into()),
        },
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let heap = size_arg(args.next().or_else(|| std::env::var("CUMEM_MALLOC_HEAP").ok()), "HEAP")?.unwrap_or(4 << 20);
    let per_block = size_arg(args.next(), "PER_BLOCK")?;

    let mm = MemoryManager::global()?;
    println!("backend: {}", mm.backend());
    if mm.backend().is_host() {
        println!("device_malloc needs a GPU: kernels call malloc() on the device. Nothing to run here.");
        return Ok(());
    }

    // First, before any module whose kernels call malloc is loaded.
    let default = mm.device_malloc_heap_size()?;
    let granted = mm.set_device_malloc_heap_size(heap)?;
    println!(
        "device malloc heap: {} by default; asked for {}, the driver granted {}",
        human_bytes(default),
        human_bytes(heap),
        human_bytes(granted)
    );

    let ctx = cumem::cuda::device_context(mm.config().device)?.expect("the CUDA backend has a context");
    let kernels = MallocKernels::load(&ctx)?;

    let big = per_block.unwrap_or(granted / 8).max(BYTES_USED as usize) as u64;
    println!(
        "round 1: {NUM_BLOCKS} blocks ask for {} each ({} in all, heap {})",
        human_bytes(big as usize),
        human_bytes(big as usize * NUM_BLOCKS as usize),
        human_bytes(granted)
    );
    let round = kernels.round(big)?;
    let served = round.check()?;
    println!("  {served} blocks got memory and computed correct values; malloc returned NULL for {}", round.failures);
    if round.failures == 0 {
        println!("  (the heap held every buffer: ask for more per block to see failures)");
    }

    println!("round 2: {NUM_BLOCKS} blocks ask for {} each", human_bytes(BYTES_USED as usize));
    let round = kernels.round(BYTES_USED)?;
    let served = round.check()?;
    println!("  {served} blocks got memory; {} failed", round.failures);

    match mm.set_device_malloc_heap_size(granted * 2) {
        Err(e @ cumem::Error::ConfigTooLate { .. }) => println!("resizing the heap now: {e}"),
        Err(e) => return Err(e.into()),
        Ok(now) => println!("resizing the heap now: the driver allowed it ({})", human_bytes(now)),
    }
    Ok(())
}
