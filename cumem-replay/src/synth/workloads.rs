//! The workloads' generators: what each allocates and frees, in order
//! (see the [parent module](super) for what each models).

use super::{Block, Issuer, Recorder, SIZE_STEP};

pub(super) const MIB: usize = 1 << 20;
/// Bytes per bf16 element.
const BF16: usize = 2;
const VOCAB: usize = 32_000;

/// `pinned_top` and `two_streams`: a 12-layer transformer (hidden 1536,
/// 12 heads) trained for 48 iterations with Adam, gradients set to `None`
/// after each step. Each iteration draws batch (1 to 3) and sequence (256
/// to 1536) anew; attention is not fused, so its scores grow with the
/// square of the sequence. With probability 0.35 an iteration caches a
/// block (2 to 40 MiB) in the middle of its forward pass, when the
/// activations below are live, and frees it 4 to 24 iterations later.
///
/// With `loader`, each iteration's input (ids, labels and a feature batch)
/// is allocated by the loader on stream 1 two iterations ahead and freed
/// on stream 0: ids and features after the embedding, labels after the
/// loss.
pub(super) fn training(r: &mut Recorder, loader: bool) {
    const H: usize = 1536;
    const HEADS: usize = 12;
    const LAYERS: usize = 12;
    const ITERATIONS: usize = 48;
    const PREFETCH: usize = 2;

    let mut weights = vec![r.allocate(VOCAB * H * BF16)];
    for _ in 0..LAYERS {
        for elems in [H, 3 * H * H, H * H, H, 4 * H * H, 4 * H * H] {
            weights.push(r.allocate(elems * BF16));
        }
    }
    let shapes: Vec<(usize, usize)> = (0..ITERATIONS).map(|_| (r.rng.range(1, 3), 64 * r.rng.range(4, 24))).collect();
    // The loader's buffers for an iteration: ids, features, labels.
    let load = |r: &mut Recorder, (batch, seq): (usize, usize)| {
        let tokens = batch * seq;
        let issuer = if loader { Issuer::Loader } else { Issuer::Compute };
        [8 * tokens, 1024 * tokens, 8 * tokens].map(|bytes| r.allocate_by(issuer, bytes))
    };
    let mut inputs: std::collections::VecDeque<[Block; 3]> = std::collections::VecDeque::new();
    if loader {
        for &shape in shapes.iter().take(PREFETCH) {
            inputs.push_back(load(r, shape));
        }
    }
    let mut adam: Vec<Block> = Vec::new();
    let mut cached: Vec<(usize, Block)> = Vec::new();
    for it in 0..ITERATIONS {
        let (batch, seq) = shapes[it];
        let tokens = batch * seq;
        let unit = tokens * H * BF16;
        if loader {
            if let Some(&shape) = shapes.get(it + PREFETCH) {
                inputs.push_back(load(r, shape));
            }
        } else {
            inputs.push_back(load(r, shapes[it]));
        }
        let [ids, features, labels] = inputs.pop_front().expect("an input per iteration");
        // Where this iteration caches a block, if it does: after a layer
        // of the forward pass, or (half the time) at the loss (`LAYERS`).
        let cache_at = r.rng.chance(0.35).then(|| if r.rng.chance(0.5) { LAYERS } else { r.rng.range(2, LAYERS - 1) });
        let cache = |r: &mut Recorder, cached: &mut Vec<(usize, Block)>| {
            let bytes = r.rng.range(2 * MIB / SIZE_STEP, 40 * MIB / SIZE_STEP) * SIZE_STEP;
            let until = it + r.rng.range(4, 24);
            cached.push((until, r.allocate(bytes)));
        };

        // Forward: each layer keeps what its backward needs.
        let mut saved: Vec<Vec<Block>> = vec![vec![r.allocate(unit)]];
        r.free(ids);
        r.free(features);
        for layer in 0..LAYERS {
            let mut keep = Vec::new();
            keep.push(r.allocate(unit)); // norm
            keep.push(r.allocate(3 * unit)); // qkv
            let scores = r.allocate(batch * HEADS * seq * seq * BF16);
            let probs = r.allocate(batch * HEADS * seq * seq * BF16);
            r.free(scores);
            keep.push(r.allocate(unit)); // attention context
            r.free(probs);
            r.temporary(unit); // output projection
            keep.push(r.allocate(unit)); // norm
            keep.push(r.allocate(4 * unit)); // mlp up
            r.temporary(4 * unit); // activation
            let small = r.rng.range(1, 128) * SIZE_STEP;
            r.temporary(small);
            keep.push(r.allocate(unit)); // residual out
            if cache_at == Some(layer) {
                cache(r, &mut cached);
            }
            saved.push(keep);
        }
        let logits = r.allocate(tokens * VOCAB * BF16);
        let log_softmax = r.allocate(tokens * VOCAB * 4); // fp32
        if cache_at == Some(LAYERS) {
            cache(r, &mut cached);
        }
        r.free(log_softmax);
        let loss = r.allocate(SIZE_STEP);
        r.free(labels);

        // Backward: gradients appear layer by layer, activations go.
        let mut grads = Vec::with_capacity(weights.len());
        let grad_logits = r.allocate(tokens * VOCAB * BF16);
        r.free(logits);
        let mut grad_x = r.allocate(unit);
        r.free(grad_logits);
        for (layer, keep) in saved.drain(1..).enumerate().rev() {
            for w in &weights[1 + 6 * layer..1 + 6 * (layer + 1)] {
                grads.push(r.allocate(w.size));
            }
            r.temporary(4 * unit);
            r.temporary(batch * HEADS * seq * seq * BF16);
            r.temporary(3 * unit);
            r.free_all(keep.into_iter().rev());
            let next = r.allocate(unit);
            r.free(std::mem::replace(&mut grad_x, next));
        }
        grads.push(r.allocate(weights[0].size));
        r.free_all(saved.pop().expect("the embedding's output"));
        r.free(grad_x);
        r.free(loss);

        // Adam: state from step one, a temporary per parameter, grads None.
        adam_step(r, &weights, &mut adam, grads);
        let (due, rest): (Vec<_>, Vec<_>) = cached.into_iter().partition(|&(until, _)| until <= it);
        cached = rest;
        r.free_all(due.into_iter().map(|(_, b)| b));
    }
    r.free_all(cached.into_iter().map(|(_, b)| b));
    r.free_all(adam);
    r.free_all(weights);
}

/// `kv_cache`: a 16-layer model (hidden 2048, 8 KV heads of 128: 64 KiB of
/// cache per token) serves 36 requests, at most 4 at a time, interleaved
/// token by token. A request has a batch of 1 to 8, a prompt of 64 to 1024
/// tokens and generates 64 to 448; its cache holds the prompt rounded up
/// to 32 tokens and grows by 32 tokens at a time: a larger block is
/// allocated, then the old one freed. The prefill allocates activations per
/// layer; each generated token a hidden state and logits.
pub(super) fn kv_cache(r: &mut Recorder) {
    const H: usize = 2048;
    const FFN: usize = 5632;
    const LAYERS: usize = 16;
    const KV_PER_TOKEN: usize = LAYERS * 2 * 8 * 128 * BF16;
    const STEP: usize = 32;
    const REQUESTS: usize = 36;
    const SLOTS: usize = 4;

    struct Request {
        batch: usize,
        len: usize,
        end: usize,
        cache: Block,
    }

    let mut weights = vec![r.allocate(VOCAB * H * BF16), r.allocate(VOCAB * H * BF16)];
    for _ in 0..LAYERS {
        for elems in [H, H * (H + 2 * 1024), H * H, H, 2 * H * FFN, FFN * H] {
            weights.push(r.allocate(elems * BF16));
        }
    }
    let (mut started, mut active): (usize, Vec<Request>) = (0, Vec::new());
    while started < REQUESTS || !active.is_empty() {
        // Admit one request per engine step while a slot is free.
        if started < REQUESTS && active.len() < SLOTS {
            started += 1;
            let batch = r.rng.pick(&[1, 1, 2, 4, 8]);
            let prompt = 32 * r.rng.range(2, 32);
            let cache = r.allocate(batch * prompt.next_multiple_of(STEP) * KV_PER_TOKEN);
            for _ in 0..LAYERS {
                let hidden = r.allocate(batch * prompt * H * BF16);
                r.temporary(batch * prompt * FFN * BF16 * 2);
                r.free(hidden);
            }
            r.temporary(batch * VOCAB * 4);
            active.push(Request { batch, len: prompt, end: prompt + 16 * r.rng.range(4, 28), cache });
        }
        let mut i = 0;
        while i < active.len() {
            let q = &mut active[i];
            let batch = q.batch;
            if q.len == q.end {
                let done = active.swap_remove(i);
                r.free(done.cache);
                continue;
            }
            q.len += 1;
            if q.len * batch * KV_PER_TOKEN > q.cache.size {
                let grown = r.allocate(batch * (q.len - 1 + STEP) * KV_PER_TOKEN);
                let old = std::mem::replace(&mut active[i].cache, grown);
                r.free(old);
            }
            let hidden = r.allocate(batch * H * BF16);
            let logits = r.allocate(batch * VOCAB * 4);
            r.free(hidden);
            r.free(logits);
            i += 1;
        }
    }
    r.free_all(weights);
}

/// `moe`: an 8-layer mixture of experts (hidden 1024, 16 experts of FFN
/// 2048 with gated activation, top 2) trained for 24 steps of 1024 to 8192
/// tokens. Each layer draws its experts' loads from a Pareto distribution
/// (shape 1.2): a few experts take most tokens, most take few, so
/// the per-expert buffers (gathered input, gate and up projection,
/// activation, output) take many sizes with a heavy tail. Forward keeps
/// each expert's buffers for backward, which frees them with gradient
/// temporaries of the same shapes. Weights are allocated once.
pub(super) fn moe(r: &mut Recorder) {
    const H: usize = 1024;
    const FFN: usize = 2048;
    const EXPERTS: usize = 16;
    const TOP_K: usize = 2;
    const LAYERS: usize = 8;
    const STEPS: usize = 24;

    let mut weights = vec![r.allocate(VOCAB * H * BF16)];
    for _ in 0..LAYERS {
        weights.push(r.allocate(4 * H * H * BF16));
        weights.push(r.allocate(H * EXPERTS * BF16));
        for _ in 0..EXPERTS {
            for elems in [H * FFN, H * FFN, FFN * H] {
                weights.push(r.allocate(elems * BF16));
            }
        }
    }
    for _ in 0..STEPS {
        let tokens = 512 * r.rng.range(2, 16);
        let mut saved: Vec<(Vec<usize>, Vec<Block>)> = Vec::with_capacity(LAYERS);
        let mut x = r.allocate(tokens * H * BF16);
        for _ in 0..LAYERS {
            r.temporary(tokens * H * BF16 * 3); // attention, fused
            let router = r.allocate(tokens * EXPERTS * 4);
            let routes = r.allocate(tokens * TOP_K * 8);
            r.free(router);
            let loads: Vec<f64> = (0..EXPERTS).map(|_| (1.0 - r.rng.unit()).powf(-1.0 / 1.2)).collect();
            let total: f64 = loads.iter().sum();
            let counts: Vec<usize> =
                loads.iter().map(|l| (l / total * (tokens * TOP_K) as f64).floor() as usize).collect();
            let mut keep = vec![x, routes];
            let mut outputs = Vec::new();
            // An expert that draws no token has no buffers.
            for &n in counts.iter().filter(|&&n| n > 0) {
                keep.push(r.allocate(n * H * BF16)); // gathered input
                keep.push(r.allocate(n * 2 * FFN * BF16)); // gate and up
                keep.push(r.allocate(n * FFN * BF16)); // activation
                outputs.push(r.allocate(n * H * BF16));
            }
            x = r.allocate(tokens * H * BF16); // combined
            r.free_all(outputs);
            saved.push((counts, keep));
        }
        let mut grad = r.allocate(tokens * H * BF16);
        r.free(x);
        for (counts, keep) in saved.into_iter().rev() {
            for &n in counts.iter().filter(|&&n| n > 0) {
                let g = r.allocate(n * FFN * BF16);
                r.temporary(n * 2 * FFN * BF16);
                r.free(g);
            }
            r.free_all(keep.into_iter().rev());
            let next = r.allocate(tokens * H * BF16);
            r.free(std::mem::replace(&mut grad, next));
        }
        r.free(grad);
    }
    r.free_all(weights);
}

/// Adam's step: its state (two tensors per weight) appears at the first
/// step, one temporary per parameter, then the gradients are set to None.
pub(super) fn adam_step(r: &mut Recorder, weights: &[Block], adam: &mut Vec<Block>, grads: Vec<Block>) {
    if adam.is_empty() {
        for i in 0..2 * weights.len() {
            adam.push(r.allocate(weights[i / 2].size));
        }
    }
    for size in weights.iter().map(|w| w.size).collect::<Vec<_>>() {
        r.temporary(size);
    }
    r.free_all(grads);
}
