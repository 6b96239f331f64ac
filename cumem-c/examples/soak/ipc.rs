//! Blocks shared with a second process: this binary run again with
//! `--ipc-child` (its standard input one end of a socket pair). Rounds
//! alternate between the Rust API (`export_device`, `IpcHandle`,
//! `ImportedMemory`) and the C ABI (`cumem_ipc_export` / `_import` /
//! `_close` / `_wait_closed`); every other round the parent frees the block while the child holds it, and
//! blocks of the same size allocated meanwhile must be other blocks.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use cudarc::driver::sys;
use cumem::ipc::{ImportedMemory, IpcHandle};
use cumem::Stream;

use crate::work::{c, err, fill, read, Res};
use crate::{pattern, Rng, Soak};

const PATIENCE: Duration = Duration::from_secs(120);

/// The seed a block filled with `pattern(seed, i)` was filled with (the
/// pattern at 0 is `seed ^ seed >> 15`, which this inverts).
fn seed_of(first: u32) -> u32 {
    first ^ (first >> 15) ^ (first >> 30)
}

/// The parent's half: rounds until the soak stops; hangs up, checks the child.
pub fn parent(s: &Soak) {
    if let Err(e) = parent_rounds(s) {
        s.error(&format!("ipc: {e}"));
    }
}

fn parent_rounds(s: &Soak) -> Res {
    s.ctx.bind_to_thread().map_err(err("bind_to_thread"))?;
    // The child's end of a socket pair is its standard input.
    let (socket, theirs) = UnixStream::pair().map_err(err("socketpair"))?;
    socket.set_read_timeout(Some(PATIENCE)).map_err(err("set_read_timeout"))?;
    let exe = std::env::current_exe().map_err(err("current_exe"))?;
    let mut child = Command::new(exe)
        .arg("--ipc-child")
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .spawn()
        .map_err(err("spawn the child"))?;
    let stream = Stream::new().map_err(err("Stream::new"))?;
    let mut rng = Rng::new(0x1bc0_0000 ^ std::process::id() as u64);
    let mut round = 0u64;
    let mut result = Ok(());
    // The child tells the parent's hang-up from a failure in the Rust
    // rounds (even ones): the parent stops before one.
    while !s.stop.load(Ordering::Relaxed) || round % 2 == 1 {
        let r = {
            let _g = s.exclusive.read().unwrap_or_else(|e| e.into_inner());
            one_round(s, &socket, &stream, round, &mut rng)
        };
        if let Err(e) = r {
            result = Err(format!("round {round}: {e}"));
            break;
        }
        s.ipc_rounds.fetch_add(1, Ordering::Relaxed);
        s.ops.fetch_add(1, Ordering::Relaxed);
        round += 1;
        std::thread::sleep(Duration::from_millis(if s.light { 200 } else { 20 }));
    }
    drop(socket);
    let status = child.wait().map_err(err("wait for the child"))?;
    result?;
    if !status.success() {
        return Err(format!("the child failed: {status}"));
    }
    Ok(())
}

fn one_round(s: &Soak, socket: &UnixStream, stream: &Stream, round: u64, rng: &mut Rng) -> Res {
    let mm = s.mm;
    // Whole 256-byte units: the handle's size is the block's (rounded up).
    let n = rng.range(1, s.max_values / 256) * 64;
    let seed = rng.next() as u32;
    let p = mm.allocate_device_on(n * 4, stream).map_err(err("allocate_device_on"))?;
    fill(s, stream.cudarc().unwrap(), p, seed, n)?;
    crate::work::check(s, "a block before its export", &read(s, stream, p, n)?, seed, 0);
    let free_early = round % 4 >= 2;
    let check_others = |p: u64| -> Res {
        // Freed while the child holds it: blocks of its size are others.
        mm.free_device_on(p, stream).map_err(err("free_device_on"))?;
        let mut others = Vec::new();
        for _ in 0..2 {
            let q = mm.allocate_device_on(n * 4, stream).map_err(err("allocate_device_on"))?;
            if q == p {
                s.wrong_values("an exported block handed out again before its release", 1);
            }
            fill(s, stream.cudarc().unwrap(), q, seed ^ 0x5555, n)?;
            others.push(q);
        }
        for q in others {
            mm.free_device_on(q, stream).map_err(err("free_device_on"))?;
        }
        stream.synchronize().map_err(err("synchronize"))
    };
    if round % 2 == 0 {
        let mut export = mm.export_device(p).map_err(err("export_device"))?;
        export.send(socket).map_err(err("send"))?;
        if free_early {
            check_others(p)?;
        }
        export.wait_closed(socket).map_err(err("wait_closed"))?;
    } else {
        let fd = socket.as_raw_fd();
        let mut id = 0u64;
        // SAFETY: `id` is valid for a write; `fd` an open Unix socket.
        c(unsafe { cumem_c::cumem_ipc_export(p as usize as *mut _, fd, &mut id) }, "cumem_ipc_export")?;
        if free_early {
            check_others(p)?;
        }
        c(cumem_c::cumem_ipc_wait_closed(fd, id), "cumem_ipc_wait_closed")?;
    }
    if !free_early {
        // The child's writes reach the parent's block.
        let seen = read(s, stream, p, n)?;
        let bad = seen.iter().filter(|&&v| v != !seed).count();
        s.wrong_values("a block the child overwrote", bad);
        mm.free_device_on(p, stream).map_err(err("free_device_on"))?;
    }
    Ok(())
}

/// The child's half: opens each block, checks it, overwrites it with the
/// complement of its seed, closes it and says so. Returns the exit code.
pub fn child() -> i32 {
    match child_rounds() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("soak child: ERROR {e}");
            1
        }
    }
}

fn child_rounds() -> Res {
    let fd = std::io::stdin().as_fd().try_clone_to_owned().map_err(err("the socket on standard input"))?;
    let socket = UnixStream::from(fd);
    socket.set_read_timeout(Some(PATIENCE)).map_err(err("set_read_timeout"))?;
    let ctx = cumem::device::device_context(0).map_err(err("device_context"))?.ok_or("no GPU in the child")?;
    ctx.bind_to_thread().map_err(err("bind_to_thread"))?;
    let mut round = 0u64;
    loop {
        if round % 2 == 0 {
            let handle = match IpcHandle::recv(&socket) {
                Ok(h) => h,
                // The parent hangs up before an even round: all done.
                Err(cumem::Error::Os { .. }) => return Ok(()),
                Err(e) => return Err(format!("IpcHandle::recv: {e}")),
            };
            if handle.exporter_pid() == std::process::id() {
                return Err("a handle from this process".into());
            }
            let m = ImportedMemory::open(handle, None).map_err(err("ImportedMemory::open"))?;
            touch(m.ptr(), m.size())?;
            m.close_and_notify(&socket).map_err(err("close_and_notify"))?;
        } else {
            let (mut p, mut size, mut id) = (std::ptr::null_mut(), 0usize, 0u64);
            let fd = socket.as_raw_fd();
            // SAFETY: the out-pointers are writable; `fd` is an open socket.
            c(unsafe { cumem_c::cumem_ipc_import(fd, -1, &mut p, &mut size, &mut id) }, "cumem_ipc_import")?;
            touch(p as u64, size)?;
            c(cumem_c::cumem_ipc_close(p, fd), "cumem_ipc_close")?;
        }
        round += 1;
    }
}

/// Checks the pattern in `size` bytes at `ptr` and overwrites them.
fn touch(ptr: u64, size: usize) -> Res {
    let n = size / 4;
    let mut v = vec![0u32; n];
    // SAFETY: `ptr` is `size` bytes of imported device memory; the parent
    // finished writing it before sending the handle.
    unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), ptr, n * 4) }.result().map_err(err("cuMemcpyDtoH"))?;
    let seed = seed_of(v[0]);
    let bad: Vec<usize> = (0..n).filter(|&i| v[i] != pattern(seed, i)).collect();
    if let (Some(&first), Some(&last)) = (bad.first(), bad.last()) {
        return Err(format!(
            "{} of {n} values at {ptr:#x} differ from the parent's pattern (seed {seed:#x}): indices {first}..={last}, \
             first {:#x} for {:#x}",
            bad.len(),
            v[first],
            pattern(seed, first)
        ));
    }
    // SAFETY: as above; nothing else writes it while the child holds it.
    unsafe { sys::cuMemsetD32_v2(ptr, !seed, n) }.result().map_err(err("cuMemsetD32"))?;
    // SAFETY: a plain context synchronisation.
    unsafe { sys::cuCtxSynchronize() }.result().map_err(err("cuCtxSynchronize"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_seed_comes_back_from_the_first_value() {
        for seed in [0u32, 1, 0xdead_beef, u32::MAX, 0x8000_0001] {
            assert_eq!(super::seed_of(crate::pattern(seed, 0)), seed);
        }
    }
}
