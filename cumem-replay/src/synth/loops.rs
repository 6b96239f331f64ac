//! Loops: a training program that repeats its step. Unlike `pinned_top`,
//! whose every iteration has a shape of its own, these repeat exactly,
//! or nearly: a layout that fits one iteration fits the next.

use super::{Block, Recorder, SIZE_STEP};
use crate::synth::workloads::{adam_step, MIB};

/// Which loop (see [`Workload`](super::Workload)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// One shape for every iteration.
    Fixed,
    /// One shape for the first half, another for the second.
    Change,
    /// Training steps and, after every second one, an evaluation pass
    /// (forward only, another shape): two loops interleaved.
    Two,
    /// Each iteration's sequence is one of four lengths, drawn at random
    /// (a GPT-2 fed prompts of varying length, bucketed).
    Lengths,
    /// One shape, but a quarter of the iterations allocate an extra block
    /// mid-forward that lives 0 to 3 iterations, and a tenth make an
    /// extra temporary: a program that departs from its loop now and then.
    Depart,
}

const H: usize = 2048;
const HEADS: usize = 16;
const LAYERS: usize = 6;
const ITERATIONS: usize = 60;
const BF16: usize = 2;

/// A 6-layer transformer (hidden 2048) trained with Adam for 60
/// iterations of the shapes `kind` says; the seed draws the batch (2 to
/// 5), the sequence (384 to 768) and the other loop's shapes.
pub(super) fn training_loop(r: &mut Recorder, kind: Kind) {
    let batch = r.rng.range(2, 5);
    let seq = 64 * r.rng.range(6, 12);
    let later = 64 * r.rng.range(4, 16);
    let eval = (r.rng.range(4, 8), 64 * r.rng.range(2, 6));
    let mut weights = Vec::new();
    for _ in 0..LAYERS {
        for elems in [H, 3 * H * H, H * H, H, 4 * H * H, 4 * H * H] {
            weights.push(r.allocate(elems * BF16));
        }
    }
    let mut adam: Vec<Block> = Vec::new();
    let mut extra: Vec<(usize, Block)> = Vec::new();
    for it in 0..ITERATIONS {
        let seq = match kind {
            Kind::Change if it >= ITERATIONS / 2 => later,
            Kind::Lengths => 128 * r.rng.range(2, 5),
            _ => seq,
        };
        let depart = kind == Kind::Depart && r.rng.chance(0.25);
        let saved = forward(r, batch, seq, depart.then_some(&mut extra).map(|e| (e, it)));
        backward(r, &weights, &mut adam, batch * seq, saved);
        if kind == Kind::Depart && r.rng.chance(0.1) {
            let bytes = r.rng.range(1, 4096) * SIZE_STEP;
            r.temporary(bytes);
        }
        if kind == Kind::Two && it % 2 == 1 {
            let saved = forward(r, eval.0, eval.1, None);
            r.free_all(saved.into_iter().flatten());
        }
        let (due, rest): (Vec<_>, Vec<_>) = extra.into_iter().partition(|&(until, _)| until <= it);
        extra = rest;
        r.free_all(due.into_iter().map(|(_, b)| b));
    }
    r.free_all(extra.into_iter().map(|(_, b)| b));
    r.free_all(adam);
    r.free_all(weights);
}

/// A forward pass: what each layer keeps for the backward pass. With
/// `extra`, a block of 1 to 64 MiB allocated after the middle layer joins
/// the list of extra blocks, freed 0 to 3 iterations after `it`.
fn forward(
    r: &mut Recorder,
    batch: usize,
    seq: usize,
    mut extra: Option<(&mut Vec<(usize, Block)>, usize)>,
) -> Vec<Vec<Block>> {
    let unit = batch * seq * H * BF16;
    let scores = batch * HEADS * seq * seq * BF16;
    let mut saved = vec![vec![r.allocate(unit)]];
    for layer in 0..LAYERS {
        let mut keep = vec![r.allocate(unit), r.allocate(3 * unit)];
        let s = r.allocate(scores);
        let p = r.allocate(scores);
        r.free(s);
        keep.push(r.allocate(unit));
        r.free(p);
        r.temporary(unit);
        keep.push(r.allocate(4 * unit));
        r.temporary(4 * unit);
        keep.push(r.allocate(unit));
        if let (Some((list, it)), true) = (extra.as_mut(), layer == LAYERS / 2) {
            let bytes = r.rng.range(2, 128) * MIB / 2;
            let until = *it + r.rng.range(0, 3);
            list.push((until, r.allocate(bytes)));
        }
        saved.push(keep);
    }
    saved
}

/// The backward pass and the optimizer step of a forward pass's `saved`
/// blocks over `tokens` tokens; Adam's state appears at the first step.
fn backward(r: &mut Recorder, weights: &[Block], adam: &mut Vec<Block>, tokens: usize, mut saved: Vec<Vec<Block>>) {
    let unit = tokens * H * BF16;
    let mut grads = Vec::with_capacity(weights.len());
    let mut grad_x = r.allocate(unit);
    for (layer, keep) in saved.drain(1..).enumerate().rev() {
        for w in &weights[6 * layer..6 * (layer + 1)] {
            grads.push(r.allocate(w.size));
        }
        r.temporary(4 * unit);
        r.temporary(3 * unit);
        r.free_all(keep.into_iter().rev());
        let next = r.allocate(unit);
        r.free(std::mem::replace(&mut grad_x, next));
    }
    r.free_all(saved.into_iter().flatten());
    r.free(grad_x);
    adam_step(r, weights, adam, grads);
}
