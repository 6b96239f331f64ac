//! Stream tags in best fit: the tag oracle (with its memo of answers),
//! the tags of merged blocks, forgetting tags.

use super::BestFit;
use crate::tag::{merge_asking, StreamTag, TagOracle};

/// [`TagOracle`], printable.
#[derive(Clone)]
pub(super) struct Oracle {
    ask: Option<TagOracle>,
    /// Tags the oracle said complete lately, each standing for every
    /// earlier free of its stream's shard (a sequence number of
    /// [`PENDING`]: every free on the stream). A tag once complete stays
    /// complete, so an answer found here needs no question: a free that
    /// merges with space left by an earlier thread asks about that
    /// thread's tag again and again, and each question locks the
    /// oracle's registry.
    memo: [std::cell::Cell<StreamTag>; MEMO],
    next: std::cell::Cell<usize>,
}

/// Answers the oracle's memo keeps.
const MEMO: usize = 8;

/// A sequence number that never completes on its own (frees of several
/// threads merged; see `cuda/free_clock.rs`).
pub(super) const PENDING: u64 = u64::MAX;

/// The bits of a sequence number that count (the top 16 name the shard).
const COUNT: u64 = (1 << 48) - 1;

impl Default for Oracle {
    fn default() -> Self {
        Oracle { ask: None, memo: std::array::from_fn(|_| std::cell::Cell::new(StreamTag::NONE)), next: 0.into() }
    }
}

impl Oracle {
    /// Whether the memo alone says a free tagged `tag` is complete.
    fn known(&self, tag: StreamTag) -> bool {
        let covers = |e: StreamTag| {
            e.stream == tag.stream
                && (e.seq == PENDING
                    || (tag.seq != PENDING && tag.seq >> 48 == e.seq >> 48 && tag.seq & COUNT <= e.seq & COUNT))
        };
        self.memo.iter().any(|e| e.get() != StreamTag::NONE && covers(e.get()))
    }

    /// Whether a free tagged `tag` (not `NONE`/`MIXED`) is known complete.
    fn done(&self, tag: StreamTag) -> bool {
        if self.known(tag) {
            return true;
        }
        let done = self.ask.as_ref().is_some_and(|ask| ask(tag));
        if done {
            let i = self.next.get();
            self.memo[i % MEMO].set(tag);
            self.next.set(i.wrapping_add(1));
        }
        done
    }
}

impl std::fmt::Debug for Oracle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.ask.is_some() { "Oracle(set)" } else { "Oracle(none)" })
    }
}

impl BestFit {
    /// Sets what merges across streams ask ([`TagOracle`]).
    pub fn set_tag_oracle(&mut self, oracle: TagOracle) {
        self.oracle = Oracle { ask: Some(oracle), ..Oracle::default() };
    }

    /// Whether the work of a free tagged `tag` is known complete: no tag,
    /// or the tag oracle says so. No driver call.
    pub fn tag_settled(&self, tag: StreamTag) -> bool {
        tag == StreamTag::NONE || (tag != StreamTag::MIXED && self.oracle.done(tag))
    }

    /// Forgets which streams' queued work may still use the free blocks:
    /// every free block gets [`StreamTag::NONE`]. For a caller that knows
    /// that work is complete or otherwise ordered (a graph-private pool at
    /// the end of a capture). Linear in the number of blocks.
    pub fn clear_tags(&mut self) {
        for b in self.blocks.iter_mut().filter(|b| b.free) {
            b.tag = StreamTag::NONE;
        }
    }

    /// The tag of a block merged from blocks tagged `a` and `b`: when the
    /// merge would lose order, a tag the memo knows complete is dropped
    /// with no question (the other stays, even if its work is complete
    /// too: a wait too many, never one too few); else the oracle is asked
    /// about both.
    pub(super) fn merge_tags(&self, a: StreamTag, b: StreamTag) -> StreamTag {
        let m = a.merge(b);
        let loses_order = m == StreamTag::MIXED || (m.seq == PENDING && m != a && m != b);
        if !loses_order || self.oracle.ask.is_none() {
            return m;
        }
        if self.oracle.known(a) {
            return b;
        }
        if self.oracle.known(b) {
            return a;
        }
        merge_asking(a, b, Some(|t| self.oracle.done(t)))
    }
}

#[cfg(test)]
mod tests;
