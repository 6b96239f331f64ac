//! The pipeline of one staged copy.
//!
//! The copy is cut into *chunks* (one DMA each) and every chunk into
//! *pieces* (one host memcpy each, a few per chunk). Chunks go through a
//! ring of `slots` staging places in one pinned block. Helper threads
//! claim pieces in order from a shared counter and copy them between the
//! caller's memory and the ring; the calling thread alone talks to the
//! driver: it queues a chunk's DMA as soon as all its pieces are in (to
//! device), or queues DMAs into free slots and publishes which chunks have
//! arrived (to host), watching each chunk's event with `cuEventQuery`.
//!
//! ```text
//! to device: pieces of chunk k -> slot k%slots (once chunk k-slots' DMA is done)
//!            all pieces in -> DMA slot -> device, event[slot]
//! to host:   DMA device -> slot k%slots (once chunk k-slots' pieces are out), event[slot]
//!            event done -> pieces of chunk k -> host memory
//! ```
//!
//! To device, copies of up to two rings go into the ring with streaming
//! stores, so their DMAs read memory rather than the cores' caches (see
//! [`Plan::new`]).
//!
//! One thread making every driver call means no two threads contend for
//! the driver's stream lock, and a chunk costs two driver calls however
//! many threads copy its pieces. Small pieces keep the pipeline's fill (to
//! device: the first chunk's memcpy) and drain (to host: the last one's)
//! short, and several threads share each chunk.
//!
//! Nobody sleeps on a lock while a copy is in flight: helpers and the
//! caller wait by spinning on atomics ([`Waiter`]), then yielding, then
//! sleeping briefly for long waits (work queued on the stream before the
//! copy). Whenever it has no driver work to do, the calling thread copies
//! the next piece too (so a copy finishes even when no helper comes: they
//! are shared by all copies).

use std::time::{Duration, Instant};

use super::streaming::copy_to_ring;
use crate::error::{Error, Result};
use crate::sync::{AtomicBool, AtomicUsize, Ordering};

/// The direction of a staged copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Direction {
    ToDevice,
    ToHost,
}

/// The smallest chunk (DMA) of a larger copy: below it, fixed costs dominate.
pub(super) const MIN_CHUNK: usize = 256 << 10;
/// Chunks a copy is cut into, where the size allows.
const CHUNKS: usize = 8;
/// Pieces a chunk is cut into, where the size allows.
const PIECES: usize = 8;
/// The smallest and largest piece (host memcpy).
const MIN_PIECE: usize = 64 << 10;
const MAX_PIECE: usize = 256 << 10;
/// The staging ring's bytes, where the chunks allow (at least two slots).
const RING: usize = 16 << 20;
/// Bytes per helper thread: more helpers on a small copy cost more (in
/// hand-offs, in threads spinning beside the copying ones) than they bring.
const PER_HELPER: usize = 2 << 20;

/// How a copy of `bytes` is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    /// Bytes of every chunk but the last.
    pub chunk: usize,
    pub chunks: usize,
    /// Bytes of every piece but the last of a chunk.
    pub piece: usize,
    /// Pieces of a chunk (the last chunk's extra pieces are empty).
    pub per_chunk: usize,
    /// Chunks the staging ring holds.
    pub slots: usize,
    /// Helper threads wanted.
    pub helpers: usize,
    /// To device: whether pieces go into the ring with stores that bypass
    /// the caches ([`copy_to_ring`]).
    pub streaming: bool,
}

impl Plan {
    /// About [`CHUNKS`] chunks of [`MIN_CHUNK`] ..= `max_chunk` bytes
    /// (multiples of 64 KiB), pieces of about an eighth of a chunk
    /// (64 ..= 256 KiB), a ring of up to 16 MiB (two slots at least), and
    /// up to `lanes` helpers, one per 2 MiB and per two pieces.
    ///
    /// Copies of up to two rings stream their pieces into the ring: there
    /// the memcpy sets the pace and each chunk's DMA starts right after
    /// its memcpy, while the chunk's lines are still modified in the
    /// copying cores' caches, which a device reads slowly (H200 host,
    /// 8 MiB: 36 GB/s streamed against 19 plain). In
    /// longer copies the DMA sets the pace, the memcpy runs a ring ahead,
    /// the chunks have left the cores' caches by the time their DMA
    /// starts, and plain stores, which keep the ring in the shared cache,
    /// are faster (256 MiB: 47 against 43 GB/s).
    pub(super) fn new(bytes: usize, max_chunk: usize, lanes: usize) -> Plan {
        let bytes = bytes.max(1);
        let chunk = bytes.div_ceil(CHUNKS).next_multiple_of(64 << 10).clamp(MIN_CHUNK.min(max_chunk), max_chunk);
        let chunk = chunk.min(bytes);
        let chunks = bytes.div_ceil(chunk);
        let piece = (chunk / PIECES).next_multiple_of(16 << 10).clamp(MIN_PIECE, MAX_PIECE).min(chunk);
        let per_chunk = chunk.div_ceil(piece);
        let slots = (RING / chunk).max(2).min(chunks);
        let helpers = (chunks * per_chunk / 2).min(bytes.div_ceil(PER_HELPER)).min(lanes);
        let streaming = chunks <= 2 * slots;
        Plan { chunk, chunks, piece, per_chunk, slots, helpers, streaming }
    }

    /// Bytes of the staging ring.
    pub(super) fn ring_bytes(&self) -> usize {
        self.slots * self.chunk
    }

    fn pieces(&self) -> usize {
        self.chunks * self.per_chunk
    }

    /// Offset and length of chunk `c` in a copy of `bytes`.
    pub(super) fn chunk_at(&self, c: usize, bytes: usize) -> (usize, usize) {
        let off = c * self.chunk;
        (off, self.chunk.min(bytes - off))
    }

    /// Piece `i`: its chunk, its offset in the copy, its offset in the
    /// ring, its length (0 for the last chunk's extra pieces).
    fn piece_at(&self, i: usize, bytes: usize) -> (usize, usize, usize, usize) {
        let (c, j) = (i / self.per_chunk, i % self.per_chunk);
        let (chunk_off, chunk_len) = self.chunk_at(c, bytes);
        let inner = j * self.piece;
        let len = chunk_len.saturating_sub(inner).min(self.piece);
        (c, chunk_off + inner, (c % self.slots) * self.chunk + inner, len)
    }
}

/// The DMA side of a copy: the driver on a GPU, a stand-in in tests.
pub(super) trait Engine {
    /// Queues the DMA of `len` bytes between the ring at `stage` and the
    /// device at offset `dev_off`, then marks `slot`'s event after it.
    fn queue(&mut self, slot: usize, stage: *mut u8, dev_off: usize, len: usize) -> Result<()>;
    /// Whether everything queued before `slot`'s latest mark is done.
    fn done(&mut self, slot: usize) -> Result<bool>;
}

/// Waits in a loop: spins first, then yields, then sleeps a little (long
/// waits are for work queued before the copy).
pub(super) struct Waiter {
    rounds: u32,
    since: Option<Instant>,
}

impl Waiter {
    pub(super) fn new() -> Waiter {
        Waiter { rounds: 0, since: None }
    }

    pub(super) fn pause(&mut self) {
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds < 512 {
            std::hint::spin_loop();
            return;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() < Duration::from_micros(500) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// One copy's shared state; pointers as integers so helpers can carry it.
pub(super) struct Job {
    pub dir: Direction,
    /// The caller's host memory.
    pub host: usize,
    /// The staging ring (pinned).
    pub stage: usize,
    pub bytes: usize,
    pub plan: Plan,
    /// The next piece to claim.
    claimed: AtomicUsize,
    /// Pieces of chunks below the gate may be copied: to device, chunks
    /// whose slot is free; to host, chunks that have arrived.
    gate: AtomicUsize,
    /// Pieces copied, per chunk.
    done: Vec<AtomicUsize>,
    /// Set when the copy failed (a driver error, a helper's panic): all stop.
    abort: AtomicBool,
}

/// Sets the abort flag when a helper unwinds.
struct AbortOnUnwind<'a>(&'a AtomicBool);

impl Drop for AbortOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

fn lost() -> Error {
    Error::InvalidState("a staging helper failed".into())
}

impl Job {
    /// # Safety
    /// `host` is valid for `bytes` reads (to device) or writes (to host)
    /// and `stage` for [`Plan::ring_bytes`] reads and writes, for the
    /// job's whole life; they don't overlap.
    pub(super) unsafe fn new(dir: Direction, host: usize, stage: usize, bytes: usize, plan: Plan) -> Job {
        let gate = match dir {
            Direction::ToDevice => plan.slots,
            Direction::ToHost => 0,
        };
        Job {
            dir,
            host,
            stage,
            bytes,
            plan,
            claimed: AtomicUsize::new(0),
            gate: AtomicUsize::new(gate),
            done: (0..plan.chunks).map(|_| AtomicUsize::new(0)).collect(),
            abort: AtomicBool::new(false),
        }
    }

    /// Copies piece `i` and counts it; its chunk is below the gate.
    fn copy_piece(&self, i: usize) {
        let (c, host_off, stage_off, len) = self.plan.piece_at(i, self.bytes);
        if len == 0 {
            self.done[c].fetch_add(1, Ordering::Release);
            return;
        }
        let host = (self.host + host_off) as *mut u8;
        let stage = (self.stage + stage_off) as *mut u8;
        // SAFETY: `Job::new`'s contract covers both ranges; the piece is
        // claimed by this thread alone, and its slot is not used by a DMA
        // (the gate: to device, the slot's previous DMA is done; to host,
        // this chunk's DMA has arrived and the next one into the slot
        // waits for this piece).
        unsafe {
            match self.dir {
                Direction::ToDevice if self.plan.streaming => copy_to_ring(host.cast_const(), stage, len),
                Direction::ToDevice => std::ptr::copy_nonoverlapping(host.cast_const(), stage, len),
                Direction::ToHost => std::ptr::copy_nonoverlapping(stage.cast_const(), host, len),
            }
        }
        self.done[c].fetch_add(1, Ordering::Release);
    }

    /// A helper's work: claims pieces in order until none are left.
    pub(super) fn help(&self) {
        let _guard = AbortOnUnwind(&self.abort);
        let pieces = self.plan.pieces();
        loop {
            let i = self.claimed.fetch_add(1, Ordering::Relaxed);
            if i >= pieces {
                return;
            }
            let c = i / self.plan.per_chunk;
            let mut w = Waiter::new();
            while self.gate.load(Ordering::Acquire) <= c {
                if self.abort.load(Ordering::Acquire) {
                    return;
                }
                w.pause();
            }
            self.copy_piece(i);
        }
    }

    /// Copies the next piece if it may; whether it did (or lost the race).
    fn help_once(&self) -> bool {
        let i = self.claimed.load(Ordering::Relaxed);
        if i >= self.plan.pieces() || i / self.plan.per_chunk >= self.gate.load(Ordering::Acquire) {
            return false;
        }
        if self.claimed.compare_exchange(i, i + 1, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            self.copy_piece(i);
        }
        true
    }

    fn chunk_done(&self, c: usize) -> bool {
        self.done[c].load(Ordering::Acquire) == self.plan.per_chunk
    }

    fn queue(&self, engine: &mut impl Engine, c: usize) -> Result<()> {
        let (off, len) = self.plan.chunk_at(c, self.bytes);
        let slot = c % self.plan.slots;
        engine.queue(slot, (self.stage + slot * self.plan.chunk) as *mut u8, off, len)
    }

    /// The calling thread's part: every driver call of the copy, and,
    /// whenever it has no driver work, the next piece that may be copied
    /// (so the copy finishes even when no helper comes). Returns once all
    /// data has arrived; on an error, stops the helpers.
    pub(super) fn drive(&self, engine: &mut impl Engine) -> Result<()> {
        let r = match self.dir {
            Direction::ToDevice => self.drive_to_device(engine),
            Direction::ToHost => self.drive_to_host(engine),
        };
        if r.is_err() {
            self.abort.store(true, Ordering::Release);
        }
        r
    }

    fn drive_to_device(&self, engine: &mut impl Engine) -> Result<()> {
        let Plan { chunks, slots, .. } = self.plan;
        let (mut queued, mut retired) = (0, 0);
        let mut w = Waiter::new();
        while queued < chunks {
            if self.abort.load(Ordering::Acquire) {
                return Err(lost());
            }
            if self.chunk_done(queued) {
                self.queue(engine, queued)?;
                queued += 1;
            } else if retired < queued && engine.done(retired % slots)? {
                // The slot's DMA is done: the chunk `slots` later may fill
                // it. (Copies that fit the ring once ran at about the rate
                // of memcpy and DMA one after the other; a timeline showed
                // DMAs queued on time but running at half rate, reading
                // lines still in the cores' caches: see `Plan::new`.)
                retired += 1;
                self.gate.store(retired + slots, Ordering::Release);
            } else if !self.help_once() {
                w.pause();
                continue;
            }
            w = Waiter::new();
        }
        // The stream runs the DMAs in order: the last one done means all.
        let last = (chunks - 1) % slots;
        while !engine.done(last)? {
            w.pause();
        }
        Ok(())
    }

    fn drive_to_host(&self, engine: &mut impl Engine) -> Result<()> {
        let Plan { chunks, slots, .. } = self.plan;
        let (mut queued, mut arrived, mut retired) = (0, 0, 0);
        let mut w = Waiter::new();
        while retired < chunks {
            if self.abort.load(Ordering::Acquire) {
                return Err(lost());
            }
            if queued < chunks && queued < retired + slots {
                // The slot's previous chunk has been copied out.
                self.queue(engine, queued)?;
                queued += 1;
            } else if arrived < queued && engine.done(arrived % slots)? {
                arrived += 1;
                self.gate.store(arrived, Ordering::Release);
            } else if retired < arrived && self.chunk_done(retired) {
                retired += 1;
            } else if !self.help_once() {
                w.pause();
                continue;
            }
            w = Waiter::new();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
