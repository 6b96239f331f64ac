//! Which copy of the library a caller reaches. A process that loaded two
//! copies of `libcumem_c.so` (two files, or one file twice) has two cumem
//! managers, each with its own pools, tags and configuration: memory
//! allocated through one is unknown to the other. Comparing
//! [`cumem_instance_id`] as seen by two callers (cumem_torch's Python side
//! and its native backend) tells whether they share one manager.

/// A private static of this copy of the library. Not exported, so every
/// reference to it is relative to this copy's own code (never resolved
/// through symbol interposition to another copy); not zero, so it lives
/// in the file's read-only data (a mapping named after the file in
/// `/proc/self/maps`) rather than in anonymous memory.
static ANCHOR: u8 = 1;

/// An identity of the loaded copy of cumem's library, and so of the
/// manager the calls reach: equal for every caller of this copy, different
/// for another copy. It is a private static's address, inside the
/// library's own mapping (`/proc/self/maps` names the file). Never 0;
/// creates no manager, cannot fail.
#[no_mangle]
pub extern "C" fn cumem_instance_id() -> u64 {
    std::ptr::addr_of!(ANCHOR) as usize as u64
}
