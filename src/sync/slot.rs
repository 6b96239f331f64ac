//! Thread slots: a small number per thread, the lowest one free, given
//! back when the thread exits. Stream free counters are sharded by it; it
//! is an identity only and orders no memory.

use std::cell::Cell;

use crate::sync::StaticAtomicU64;

/// Slots in use, one bit each. Slot numbers are identities only (they
/// order no memory), so std atomics in a static are fine here.
static SLOTS: [StaticAtomicU64; 4] =
    [StaticAtomicU64::new(0), StaticAtomicU64::new(0), StaticAtomicU64::new(0), StaticAtomicU64::new(0)];

/// Threads beyond the bitmap share slots by a counter.
static OVERFLOW: StaticAtomicU64 = StaticAtomicU64::new(0);

const NO_SLOT: usize = usize::MAX;

fn take_slot() -> usize {
    for (w, word) in SLOTS.iter().enumerate() {
        let mut cur = word.load(std::sync::atomic::Ordering::Relaxed);
        while cur != u64::MAX {
            let bit = (!cur).trailing_zeros();
            match word.compare_exchange_weak(
                cur,
                cur | (1 << bit),
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            ) {
                Ok(_) => return w * 64 + bit as usize,
                Err(now) => cur = now,
            }
        }
    }
    SLOTS.len() * 64 + (OVERFLOW.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as usize % (SLOTS.len() * 64))
}

fn give_slot(slot: usize) {
    if let Some(word) = SLOTS.get(slot / 64) {
        word.fetch_and(!(1 << (slot % 64)), std::sync::atomic::Ordering::Relaxed);
    }
}

/// The calling thread's slot; gives it back when the thread ends.
struct Slot(Cell<usize>);

impl Drop for Slot {
    fn drop(&mut self) {
        give_slot(self.0.get());
    }
}

#[cfg(not(loom))]
std::thread_local! {
    static SLOT: Slot = const { Slot(Cell::new(NO_SLOT)) };
}

#[cfg(loom)]
loom::thread_local! {
    static SLOT: Slot = Slot(Cell::new(NO_SLOT));
}

/// The calling thread's slot number, taken on first use (0 while
/// thread-locals are being torn down). Slots are small numbers, reused
/// after a thread exits.
#[inline]
pub(crate) fn thread_slot() -> usize {
    SLOT.try_with(|s| match s.0.get() {
        NO_SLOT => first_slot(s),
        v => v,
    })
    .unwrap_or(0)
}

#[cold]
fn first_slot(s: &Slot) -> usize {
    let v = take_slot();
    s.0.set(v);
    v
}
