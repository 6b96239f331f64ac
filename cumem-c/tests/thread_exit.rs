//! PyTorch frees tensors while a thread exits, from other thread-locals'
//! destructors, after cumem's own thread-locals may be gone: such a free
//! must still work (it once panicked inside the call, "cannot access a
//! Thread Local Storage value during or after destruction").

use std::cell::RefCell;
use std::ffi::c_void;

use cumem_c::{cumem_torch_alloc, cumem_torch_counters, cumem_torch_free, CumemStream, CumemTorchCounters};

/// Frees its block from its destructor, as a tensor held in a
/// thread-local would.
struct FreeOnExit(usize);

impl Drop for FreeOnExit {
    fn drop(&mut self) {
        // SAFETY: on the host fallback any stream value names a host queue;
        // on a GPU the legacy default stream (NULL) is a stream of the
        // primary context that outlives the call.
        unsafe { cumem_torch_free(self.0 as *mut c_void, 4096, 0, stream()) };
    }
}

fn stream() -> CumemStream {
    std::ptr::null_mut()
}

thread_local! {
    static HOLDER: RefCell<Option<FreeOnExit>> = const { RefCell::new(None) };
}

fn free_failures() -> u64 {
    let mut c = CumemTorchCounters { alloc_failures: 0, free_failures: 0, recorded_stream_waits: 0 };
    // SAFETY: `c` is valid for a write.
    unsafe { cumem_torch_counters(&mut c) };
    c.free_failures
}

#[test]
fn a_free_from_a_thread_local_destructor_at_thread_exit_works() {
    let before = free_failures();
    std::thread::spawn(|| {
        // Registered first, so destroyed after the thread-locals cumem
        // registers below (destructors run in reverse order).
        HOLDER.with(|_| {});
        // SAFETY: as in FreeOnExit::drop.
        let p = unsafe { cumem_torch_alloc(4096, 0, stream()) };
        assert!(!p.is_null());
        HOLDER.with(|h| *h.borrow_mut() = Some(FreeOnExit(p as usize)));
    })
    .join()
    .unwrap();
    assert_eq!(free_failures(), before, "the free at thread exit failed");
}
