"""The workloads of `real_workloads.py`: each builds its model from a config
with random weights (no downloads), runs warm-up and timed steps, and
records every step's time and value (a loss, a logit or a token). Also
the step timer the two-GPU benchmark (`ddp.py`) shares.

A workload's `p["shapes"]`, where given, replaces its seeded random draw of
each step's shape with that list, in turn (`fit.py` gives schedules that
grow with its knob); without it the draws are the ones the published
tables were measured with."""

import functools
import itertools
import random
import time


class StepTimes(list):
    """A step-time list (seconds of wall time, as before) that also gets
    each step's time on the device, from CUDA events recorded on the
    current stream around the step, in `gpu` (seconds)."""

    def __init__(self):
        super().__init__()
        self.gpu = []


def timed_step(torch, fn, times, record):
    torch.cuda.synchronize()
    events = None
    if record and hasattr(times, "gpu"):
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    t0 = time.perf_counter()
    value = fn()
    if events is not None:
        events[1].record()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if record:
        times.append(dt)
        if events is not None:
            times.gpu.append(events[0].elapsed_time(events[1]) / 1e3)
    return value


def schedule(p, draw):
    """The shape of the next step: `p["shapes"]` in turn where given, else
    `draw()` (the workload's seeded random draw)."""
    shapes = p.get("shapes")
    return functools.partial(next, itertools.cycle(shapes)) if shapes else draw


def length8(rng, lo, hi):
    """A length drawn from lo..hi, a multiple of 8."""
    return rng.randrange(lo // 8, hi // 8 + 1) * 8


def build(torch, make):
    """`make()` on the device after seeding: every process builds the same
    weights."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        return make()


def train_steps(torch, p, model, loss_of, times, values, opt=None):
    """Warm-up and timed training steps of `model` (with `opt`, by default
    AdamW at 1e-4): `loss_of()` makes a batch and returns its loss (run
    under bf16 autocast, which leaves the random inputs as they are); then
    backward, the optimizer's step, gradients dropped. A step's value is
    its loss."""
    model.train()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for i in range(p["warmup"] + p["steps"]):
        values.append(timed_step(torch, step, times, i >= p["warmup"]))


def gpt2_varlen(torch, p, times, values):
    """GPT-2 small training, batches of varying sequence length."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=p.get("positions", 1024), vocab_size=50257,
                     attn_implementation="eager")
    model = build(torch, lambda: GPT2LMHeadModel(cfg))
    rng = random.Random(1234)
    gen = torch.Generator(device="cuda").manual_seed(42)
    next_length = schedule(p, lambda: length8(rng, p["min_len"], p["max_len"]))

    def loss_of():
        length = next_length()
        ids = torch.randint(0, cfg.vocab_size, (p["batch"], length), device="cuda", generator=gen)
        return model(input_ids=ids, labels=ids).loss

    train_steps(torch, p, model, loss_of, times, values)


def resnet50(torch, p, times, values):
    """ResNet-50 training, fixed batch, cudnn.benchmark on (as vision does)."""
    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = False
    try:
        torch.manual_seed(0)
        model = torchvision.models.resnet50(weights=None).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator(device="cuda").manual_seed(7)
        loss_fn = torch.nn.CrossEntropyLoss()

        def loss_of():
            x = torch.randn(p["batch"], 3, p["image"], p["image"], device="cuda", generator=gen)
            y = torch.randint(0, 1000, (p["batch"],), device="cuda", generator=gen)
            return loss_fn(model(x), y)

        train_steps(torch, p, model, loss_of, times, values, opt)
    finally:
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def encoder_bucketed(torch, p, times, values):
    """A BERT-style encoder trained on length-bucketed batches: a fixed
    token budget per batch, so short sequences come in big batches and long
    ones in small ones (batch and length both vary)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                     intermediate_size=4 * p["hidden"], vocab_size=30522,
                     max_position_embeddings=p.get("positions", 1024),
                     attn_implementation="eager")
    model = build(torch, lambda: BertForMaskedLM(cfg))
    rng = random.Random(5)
    gen = torch.Generator(device="cuda").manual_seed(11)
    next_length = schedule(p, lambda: rng.choice(p["buckets"]))

    def loss_of():
        length = next_length()
        batch = max(1, p["tokens"] // length)
        ids = torch.randint(0, cfg.vocab_size, (batch, length), device="cuda", generator=gen)
        labels = torch.where(torch.rand(ids.shape, device="cuda", generator=gen) < 0.15, ids, -100)
        return model(input_ids=ids, labels=labels).loss

    train_steps(torch, p, model, loss_of, times, values)


def seq2seq_varlen(torch, p, times, values):
    """A T5-style encoder-decoder trained on pairs of varying lengths."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=p["d_model"], d_ff=4 * p["d_model"], num_layers=p["layers"],
                   num_decoder_layers=p["layers"], num_heads=p["heads"], d_kv=p["d_model"] // p["heads"],
                   vocab_size=32128, decoder_start_token_id=0, pad_token_id=0)
    model = build(torch, lambda: T5ForConditionalGeneration(cfg))
    rng = random.Random(8)
    gen = torch.Generator(device="cuda").manual_seed(13)
    next_lengths = schedule(p, lambda: (length8(rng, p["min_src"], p["max_src"]),
                                        length8(rng, p["min_tgt"], p["max_tgt"])))

    def loss_of():
        src, tgt = next_lengths()
        ids = torch.randint(1, cfg.vocab_size, (p["batch"], src), device="cuda", generator=gen)
        labels = torch.randint(1, cfg.vocab_size, (p["batch"], tgt), device="cuda", generator=gen)
        return model(input_ids=ids, labels=labels).loss

    train_steps(torch, p, model, loss_of, times, values)


def vit_prefetch(torch, p, times, values):
    """A vision transformer (torchvision ViT-B/16) trained on batches a
    side-stream prefetcher copies from pinned host memory: the usual
    pattern (copy on a side stream, `wait_stream`, `record_stream`), with
    no host synchronisation inside the loop. The step time is the loop's
    time over its steps; the losses are read at the end."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.vit_b_16(weights=None, image_size=p["image"]).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(21)
    host = [(torch.randn(p["batch"], 3, p["image"], p["image"], generator=g).pin_memory(),
             torch.randint(0, 1000, (p["batch"],), generator=g).pin_memory()) for _ in range(4)]
    side = torch.cuda.Stream()
    state = {"i": 0}

    def preload():
        x, y = host[state["i"] % len(host)]
        state["i"] += 1
        with torch.cuda.stream(side):
            state["x"] = x.cuda(non_blocking=True)
            state["y"] = y.cuda(non_blocking=True)

    def next_batch():
        cur = torch.cuda.current_stream()
        cur.wait_stream(side)
        x, y = state["x"], state["y"]
        x.record_stream(cur)
        y.record_stream(cur)
        preload()
        return x, y

    losses = []

    def step():
        x, y = next_batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    preload()
    for _ in range(p["warmup"]):
        step()
    loop = StepTimes()
    timed_step(torch, lambda: [step() for _ in range(p["steps"])], loop, True)
    times.extend([loop[0] / p["steps"]] * p["steps"])
    if hasattr(times, "gpu"):
        times.gpu.extend([loop.gpu[0] / p["steps"]] * p["steps"])
    values.extend(float(v) for v in torch.stack(losses).float().cpu())


def llama_model(torch, p):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                      num_key_value_heads=p["kv_heads"], intermediate_size=p["intermediate"], vocab_size=32000,
                      max_position_embeddings=p.get("positions", 4096), attn_implementation=p.get("attn", "sdpa"),
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = build(torch, lambda: LlamaForCausalLM(cfg).to(torch.bfloat16))
    model.eval()
    return cfg, model


def llama_generate(torch, p, times, values):
    """Greedy generation with a Llama-style model and a growing KV cache
    (transformers' DynamicCache): rounds of prompts of varying length, one
    step per new token; the value of a step is the sum of its last logits."""
    from transformers import DynamicCache

    cfg, model = llama_model(torch, p)
    rng = random.Random(99)
    gen = torch.Generator(device="cuda").manual_seed(3)
    done = 0
    with torch.inference_mode():
        for _ in range(p["rounds"]):
            length = rng.randrange(p["min_prompt"], p["max_prompt"] + 1)
            ids = torch.randint(0, cfg.vocab_size, (p["batch"], length), device="cuda", generator=gen)
            cache = DynamicCache()
            state = {"next": ids}

            def step():
                out = model(input_ids=state["next"], past_key_values=cache, use_cache=True, logits_to_keep=1)
                logits = out.logits[:, -1, :]
                state["next"] = logits.argmax(dim=-1, keepdim=True)
                return logits.float().sum().item()

            for _ in range(p["new_tokens"]):
                values.append(timed_step(torch, step, times, done >= p["warmup"]))
                done += 1
            del cache, state, ids


def generate_padded(torch, p, times, values):
    """transformers' `generate()` (greedy) on left-padded batches of varying
    size and prompt length, as a server batching requests sees them; one
    step per `generate()` call, its value the sum of the tokens made."""
    cfg, model = llama_model(torch, p)
    rng = random.Random(17)
    gen = torch.Generator(device="cuda").manual_seed(5)

    def draw():
        batch = rng.randrange(p["min_batch"], p["max_batch"] + 1)
        return [rng.randrange(p["min_prompt"], p["max_prompt"] + 1) for _ in range(batch)]

    next_prompts = schedule(p, draw)
    with torch.inference_mode():
        for i in range(p["warmup"] + p["steps"]):
            lens = next_prompts()
            batch = len(lens)
            width = max(lens)
            ids = torch.full((batch, width), cfg.pad_token_id, dtype=torch.long, device="cuda")
            mask = torch.zeros((batch, width), dtype=torch.long, device="cuda")
            for r, n in enumerate(lens):
                ids[r, width - n:] = torch.randint(3, cfg.vocab_size, (n,), device="cuda", generator=gen)
                mask[r, width - n:] = 1

            def step():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=p["new_tokens"],
                                     min_new_tokens=p["new_tokens"], do_sample=False,
                                     pad_token_id=cfg.pad_token_id)
                return float(out[:, width:].sum().item())

            values.append(timed_step(torch, step, times, i >= p["warmup"]))


def gpt_compiled(torch, p, times, values):
    """A small GPT in plain PyTorch (token and position embeddings,
    pre-norm blocks of causal SDPA attention and a GELU MLP, the head tied
    to the embedding) trained with AdamW under bf16 autocast, the model's
    forward and backward compiled with `torch.compile(mode=
    "reduce-overhead")`: CUDA graph trees, which keep the graphs' memory in
    a graph-private pool. Fixed batch and length; `p["dynamic"]` compiles
    for any length (so processes of other lengths reuse the compile cache)."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(d, dim=2))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(p["vocab"], p["hidden"])
            self.pos = nn.Embedding(p["positions"], p["hidden"])
            self.blocks = nn.ModuleList(Block(p["hidden"], p["heads"]) for _ in range(p["layers"]))
            self.ln = nn.LayerNorm(p["hidden"])

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln(x), self.tok.weight)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    model = build(torch, GPT)
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=p.get("dynamic", False))
    gen = torch.Generator(device="cuda").manual_seed(23)

    def loss_of():
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(torch.randint(0, p["vocab"], (p["batch"], p["length"]), device="cuda", generator=gen))

    train_steps(torch, p, model, loss_of, times, values)


RUNNERS = {"gpt2_varlen": gpt2_varlen, "resnet50": resnet50, "llama_generate": llama_generate,
           "llama_generate_eager": llama_generate, "encoder_bucketed": encoder_bucketed,
           "seq2seq_varlen": seq2seq_varlen, "vit_prefetch": vit_prefetch, "generate_padded": generate_padded,
           "gpt_compiled": gpt_compiled}
