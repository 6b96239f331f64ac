//! Learned placement: a remapping pool that learns the sequence its
//! program repeats and places the next repetitions by a plan.
//!
//! # Implementation details
//!
//! Best fit places each block where the free space of the moment says;
//! a training or serving loop's layout then shifts a little from one
//! iteration to the next, the pages its blocks touch over an iteration
//! exceed what they touch at once, and a pool held at its page floor
//! moves memory (`remap.rs`). A plan made knowing every block's lifetime
//! keeps the layout still: the same block of each iteration lands at the
//! same address, inside memory that stays mapped.
//!
//! - **Record** (under the pool lock, a few table updates per
//!   operation): each allocation's size, address and lifetime, measured
//!   on a clock that ticks once per allocation and free, in a log of at
//!   most [`LOG_MAX`] entries (then the log starts again; a plan made
//!   stays).
//! - **Detect**: the sizes of the last [`CONTEXT`] allocations (the
//!   *context*) are hashed; the first log position where each context
//!   was seen is kept. When the context of this allocation was seen
//!   before, the program is taken to repeat what followed it then: the
//!   *window* is the log from that earlier context to this one's start
//!   (one period of the loop; a whole pass of a program that runs the
//!   same steps again).
//!   A window whose blocks mostly stay live (a repeat of layers inside
//!   an iteration) is not planned.
//! - **Plan** (on a thread of its own, `cumem-plan`, with no lock held;
//!   one window at a time, at most once per twice the last window's
//!   allocations): the window's blocks are
//!   placed greedy by size over their lifetimes (`learn/place.rs`) in the
//!   pool's chunks, around everything that is fixed now: the blocks the
//!   context just allocated (this repetition's first blocks, pinned where
//!   they are), the window's blocks still live (they live into this
//!   repetition: pinned where they are, and their address kept for the
//!   start of the next), every other live block, and every page with no
//!   memory mapped (so a plan only uses memory the pool holds and maps
//!   nothing).
//! - **Follow**: once the plan is installed, the first allocation whose
//!   context was first seen inside the window starts the following there;
//!   the next allocations are expected to be the window's, in order
//!   (wrapping at its end). One whose size is the one expected is placed
//!   at its planned address when the free block there holds it and its
//!   pages are mapped ([`BestFit::allocate_at`](super::BestFit::allocate_at));
//!   otherwise best fit places it. A size expected one further on skips
//!   the one the program left out; any other size is placed by best fit
//!   and the cursor waits; more than [`STRAYS`] of those in a row end the
//!   following (a *departure*). Detection goes on: a context seen inside
//!   the window resumes it there, one seen elsewhere makes a new plan
//!   (the sequence changed).
//!
//! Measured (`docs/results.md`): a loop that repeats exactly is followed
//! (99 % of its allocations placed as planned in the host model test), but
//! on the replayed traces it does not beat best fit with mapped runs
//! (`remap.rs`), which already moves no memory on loops that repeat
//! exactly; a plan arrives a few milliseconds after the repeat is seen,
//! too late for a replay's second pass. Off by default.
//!
//! A planned placement is an ordinary placement of a free range: the
//! block carries the free block's stream tag as best fit's would (the
//! caller orders its work after it), the page book and the budget are
//! the same, and nothing is placed on a live block or a hole. So a plan
//! that is wrong costs placements, never correctness. Pools with
//! [`PoolConfig::keep_chunks`](super::PoolConfig::keep_chunks) (graph
//! pools) never remap and so never learn.

mod place;

use place::{Item, Occupied};

/// Allocations hashed into a context.
pub(super) const CONTEXT: usize = 8;

/// The most allocations the log holds before it starts again.
pub(super) const LOG_MAX: usize = 1 << 17;

/// The shortest window planned (shorter repeats are layers inside an
/// iteration, not the loop).
const MIN_WINDOW: usize = 4 * CONTEXT;

/// Unforeseen allocations in a row that end the following.
const STRAYS: u32 = 2;

/// A lifetime that has not ended.
const OPEN: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Rec {
    size: usize,
    addr: usize,
    t0: u32,
    t1: u32,
}

/// A plan: the window's sizes and planned addresses (0: none).
#[derive(Debug, Default)]
struct Plan {
    sizes: Vec<usize>,
    addrs: Vec<usize>,
    /// The log position of the window's first allocation, and the log's
    /// epoch then.
    lo: usize,
    epoch: u64,
}

/// Counts of what learning did (statistics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LearnStats {
    /// Plans made.
    pub plans: u64,
    /// Allocations placed at their planned address.
    pub planned: u64,
    /// Allocations expected by the plan that best fit placed instead (the
    /// planned range was not free, not mapped, or not planned).
    pub missed: u64,
    /// Times the program left the plan (more than two allocations in a
    /// row it did not foresee).
    pub departures: u64,
}

/// What a pool with learned placement keeps (under its lock).
#[derive(Debug, Default)]
pub(super) struct Learner {
    clock: u32,
    log: Vec<Rec>,
    /// Bumped each time the log starts again.
    epoch: u64,
    /// Live blocks the log knows: address → log position.
    live: hashbrown::HashMap<usize, u32>,
    /// The sizes of the last allocations, a ring of [`CONTEXT`].
    ring: [usize; CONTEXT],
    /// Context hash → the log position after its first occurrence.
    first_seen: hashbrown::HashMap<u64, u32>,
    plan: Option<Plan>,
    /// The plan position the next allocation is expected at.
    cursor: Option<usize>,
    /// Allocations since the last plan, and that plan's window length.
    since_plan: usize,
    last_window: usize,
    /// A window is being planned (at most one at a time).
    planning: bool,
    /// Allocations in a row that the plan did not foresee.
    strays: u32,
    pub(super) stats: LearnStats,
}

/// A window to plan, taken under the pool lock and planned outside it.
#[derive(Debug)]
pub(super) struct Window {
    lo: usize,
    epoch: u64,
    recs: Vec<Rec>,
    /// The addresses of this repetition's first [`CONTEXT`] blocks.
    context: Vec<usize>,
    /// The clock at the window's start and at this repetition's start.
    t0: u32,
    t1: u32,
    /// Live blocks now `(addr, size)`, holes, and the chunks.
    live: Vec<(usize, usize)>,
    holes: Vec<(usize, usize)>,
    chunks: Vec<(usize, usize)>,
}

/// The planned addresses of a window.
#[derive(Debug)]
pub(super) struct Planned {
    lo: usize,
    epoch: u64,
    sizes: Vec<usize>,
    addrs: Vec<usize>,
}

fn context_hash(ring: &[usize; CONTEXT], at: usize) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for k in 0..CONTEXT {
        h = (h ^ ring[(at + k) % CONTEXT] as u64).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(5);
    }
    h
}

impl Learner {
    /// The address the plan gives the next allocation (of `size` bytes,
    /// rounded), if it expects one of that size there. When the size is
    /// the one expected after the next, the program skipped one: the
    /// cursor moves past it. Any other size is an allocation the plan did
    /// not foresee ([`allocated`](Self::allocated) decides whether the
    /// program departed).
    #[inline]
    pub(super) fn expect(&mut self, size: usize) -> Option<usize> {
        let k = self.cursor?;
        let plan = self.plan.as_ref()?;
        let next = if k + 1 == plan.sizes.len() { 0 } else { k + 1 };
        let k = if plan.sizes[k] != size && plan.sizes[next] == size {
            self.cursor = Some(next);
            next
        } else {
            k
        };
        (plan.sizes[k] == size).then_some(plan.addrs[k]).filter(|&a| a != 0)
    }

    /// Records an allocation of `size` bytes at `addr` and moves the
    /// plan's cursor on. Returns the log position whose window is to be
    /// planned when this allocation's context repeats one seen outside
    /// the plan ([`window`](Self::window)).
    pub(super) fn allocated(&mut self, addr: usize, size: usize) -> Option<usize> {
        if let (Some(k), Some(plan)) = (self.cursor, &self.plan) {
            if plan.sizes[k] == size {
                if plan.addrs[k] == addr {
                    self.stats.planned += 1;
                } else {
                    self.stats.missed += 1;
                }
                self.cursor = Some(if k + 1 == plan.sizes.len() { 0 } else { k + 1 });
                self.strays = 0;
            } else {
                // Not foreseen: a stray allocation, or the program left the
                // loop. After [`STRAYS`] in a row, it left.
                self.strays += 1;
                if self.strays > STRAYS {
                    self.cursor = None;
                    self.strays = 0;
                    self.stats.departures += 1;
                }
            }
        }
        if self.log.len() >= LOG_MAX || self.clock >= OPEN - 2 {
            self.restart();
        }
        let at = self.log.len();
        self.log.push(Rec { size, addr, t0: self.clock, t1: OPEN });
        self.live.insert(addr, at as u32);
        self.clock += 1;
        self.ring[at % CONTEXT] = size;
        self.since_plan += 1;
        if at + 1 < CONTEXT {
            return None;
        }
        let h = context_hash(&self.ring, at + 1);
        let q = *self.first_seen.entry(h).or_insert(at as u32 + 1) as usize;
        if self.cursor.is_some() || q == at + 1 {
            return None;
        }
        // This context was seen before: the next allocation is log `q`'s.
        if let Some(plan) = &self.plan {
            if plan.epoch == self.epoch && q >= plan.lo && q < plan.lo + plan.sizes.len() {
                self.cursor = Some(q - plan.lo);
                return None;
            }
        }
        let window = at + 1 - q;
        let due = self.since_plan >= 2 * self.last_window;
        if window < MIN_WINDOW || !due || self.planning {
            return None;
        }
        // A loop's window closes: most of its blocks are freed within it.
        // A repeat inside an iteration (layers) leaves most live: not
        // planned, and not looked at again for a while.
        let closed = self.log[q - CONTEXT..at + 1 - CONTEXT].iter().filter(|r| r.t1 != OPEN).count();
        if closed * 4 < window * 3 {
            self.since_plan = 0;
            self.last_window = (window / 4).max(1);
            return None;
        }
        self.planning = true;
        self.since_plan = 0;
        self.last_window = window;
        Some(q)
    }

    /// Records a free of the block at `addr`.
    #[inline]
    pub(super) fn freed(&mut self, addr: usize) {
        if let Some(i) = self.live.remove(&addr) {
            self.log[i as usize].t1 = self.clock;
        }
        self.clock = self.clock.saturating_add(1);
    }

    /// Starts the log again (a plan made stays, for the epoch it knew).
    fn restart(&mut self) {
        self.log.clear();
        self.live.clear();
        self.first_seen.clear();
        self.clock = 0;
        self.epoch += 1;
    }

    /// The window that ends at the context before log position `q`'s
    /// repeat (see [`allocated`](Self::allocated)), with the live blocks,
    /// holes and chunks the plan must go around.
    pub(super) fn window(
        &self,
        q: usize,
        live: Vec<(usize, usize)>,
        holes: Vec<(usize, usize)>,
        chunks: Vec<(usize, usize)>,
    ) -> Window {
        let now = self.log.len();
        let (lo, hi) = (q - CONTEXT, now - CONTEXT);
        Window {
            lo,
            epoch: self.epoch,
            recs: self.log[lo..hi].to_vec(),
            context: self.log[hi..now].iter().map(|r| r.addr).collect(),
            t0: self.log[lo].t0,
            t1: self.log[hi].t0,
            live,
            holes,
            chunks,
        }
    }

    /// Takes a plan made from a window of this log (ignored if the log
    /// started again since). Following starts at the next allocation whose
    /// context was first seen inside the window.
    pub(super) fn install(&mut self, p: Planned) {
        self.planning = false;
        if p.epoch != self.epoch || p.sizes.is_empty() {
            return;
        }
        self.stats.plans += 1;
        self.cursor = None;
        self.plan = Some(Plan { sizes: p.sizes, addrs: p.addrs, lo: p.lo, epoch: p.epoch });
    }

    /// Gives up the window being planned.
    #[cfg_attr(loom, allow(dead_code))]
    pub(super) fn abandon(&mut self) {
        self.planning = false;
    }
}

impl Window {
    /// Plans the window (no lock held: it takes milliseconds for tens of
    /// thousands of blocks).
    pub(super) fn plan(self) -> Planned {
        let span = self.t1 - self.t0;
        let mut pinned = std::collections::HashSet::with_capacity(self.context.len() * 2);
        let mut fixed = Vec::new();
        let items: Vec<Item> = self
            .recs
            .iter()
            .enumerate()
            .map(|(j, r)| {
                let (t0, t1) = (r.t0 - self.t0, r.t1.min(self.t1).saturating_sub(self.t0));
                if j < CONTEXT {
                    // This repetition's first blocks are where they are.
                    pinned.insert(self.context[j]);
                    return Item { size: r.size, t0, t1, pinned: Some(self.context[j]) };
                }
                if r.t1 == OPEN || r.t1 > self.t1 {
                    // Lives into this repetition: stays, and its address
                    // is kept at the start of the next one as long.
                    pinned.insert(r.addr);
                    let over = if r.t1 == OPEN { span } else { (r.t1 - self.t1).min(span) };
                    fixed.push(Occupied { t0: 0, t1: over, a0: r.addr, a1: r.addr + r.size });
                    return Item { size: r.size, t0, t1: span, pinned: Some(r.addr) };
                }
                Item { size: r.size, t0, t1, pinned: None }
            })
            .collect();
        let mut always: Vec<(usize, usize)> =
            self.live.iter().filter(|(a, _)| !pinned.contains(a)).map(|&(a, s)| (a, a + s)).collect();
        let mut chunks = self.chunks;
        chunks.sort_unstable();
        let space = (chunks.first().map_or(0, |c| c.0), chunks.last().map_or(0, |c| c.0 + c.1));
        always.extend(chunks.windows(2).map(|w| (w[0].0 + w[0].1, w[1].0)));
        always.extend(self.holes);
        let out = place::place(&items, &fixed, &mut always, space, span);
        Planned {
            lo: self.lo,
            epoch: self.epoch,
            sizes: self.recs.iter().map(|r| r.size).collect(),
            addrs: out.into_iter().map(|a| a.unwrap_or(0)).collect(),
        }
    }
}
