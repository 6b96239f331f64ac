//! The building blocks of the tasks: kernels queued on a stream, values
//! read back and checked, C statuses as errors.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cumem::{PinnedAlloc, PinnedVec, Stream};
use cumem_c::CumemStatus;

use crate::{pattern, Soak};

/// A task's outcome: an error names the call that failed.
pub type Res = Result<(), String>;

pub fn err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

pub fn c(status: CumemStatus, what: &str) -> Res {
    if status == CumemStatus::Ok {
        return Ok(());
    }
    // SAFETY: a NUL-terminated string, valid until this thread's next failure.
    let msg = unsafe { std::ffi::CStr::from_ptr(cumem_c::cumem_last_error()) }.to_string_lossy().into_owned();
    Err(format!("{what}: {status:?}: {msg}"))
}

fn launch_cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// Queues `fill(p, seed, n)` on `stream`.
pub fn fill(s: &Soak, stream: &Arc<CudaStream>, p: u64, seed: u32, n: usize) -> Res {
    let (nn, reps) = (n as u64, s.reps);
    let mut l = stream.launch_builder(&s.fill);
    l.arg(&p).arg(&seed).arg(&nn).arg(&reps);
    // SAFETY: the arguments match the kernel; `p` holds at least `n` u32.
    unsafe { l.launch(launch_cfg(n)) }.map(|_| ()).map_err(err("launch fill"))
}

/// Queues `dst[i] = src[i] + k` on `stream`.
pub fn add_copy(f: &CudaFunction, stream: &Arc<CudaStream>, dst: u64, src: u64, k: u32, n: usize) -> Res {
    let nn = n as u64;
    let mut l = stream.launch_builder(f);
    l.arg(&dst).arg(&src).arg(&k).arg(&nn);
    // SAFETY: the arguments match the kernel; both hold at least `n` u32.
    unsafe { l.launch(launch_cfg(n)) }.map(|_| ()).map_err(err("launch add_copy"))
}

/// Counts the values of `v` that differ from `pattern(seed, i) + k`.
pub fn check(s: &Soak, what: &str, v: &[u32], seed: u32, k: u32) {
    let bad: Vec<usize> = (0..v.len()).filter(|&i| v[i] != pattern(seed, i).wrapping_add(k)).collect();
    if let (Some(&first), Some(&last)) = (bad.first(), bad.last()) {
        let at = format!(
            "{what} ({} values; indices {first}..={last}, first {:#x} for {:#x})",
            v.len(),
            v[first],
            pattern(seed, first).wrapping_add(k)
        );
        s.wrong_values(&at, bad.len());
    }
}

/// Reads `n` values at `p` after `stream`'s work, through a pinned vector.
pub fn read(s: &Soak, stream: &Stream, p: u64, n: usize) -> Result<Vec<u32>, String> {
    let mut host: PinnedVec<u32> = PinnedVec::with_capacity_in(n, PinnedAlloc);
    host.resize(n, 0);
    // SAFETY: `host` holds `n` values and is not touched until the stream
    // is synchronised; `p` holds `n` values written by work on `stream`.
    unsafe { s.mm.copy_to_host_async(host.as_mut_ptr().cast(), p, n * 4, stream) }
        .map_err(err("copy_to_host_async"))?;
    stream.synchronize().map_err(err("synchronize"))?;
    Ok(host.to_vec())
}
