"""Real PyTorch workloads in a benchmark process: the allocators
(PyTorch's caching allocator `pytorch`, the same with
`expandable_segments:True` `expandable`, PyTorch's cudaMallocAsync
backend, cumem through `cumem_torch.install()`) and their environments,
each workload's sizes, the process's deterministic start, the thread that
samples physical device memory, and one workload's run with its figures.
steptime.py drives processes of them (alternated, with intervals), fit.py
and probes.py the largest size that fits, ddp.py the multi-GPU runs.

Models are built from configs with random weights (no downloads), seeded,
under deterministic settings: the loss (for generation, logit or token)
sequence of a process can be compared bit for bit with another's.

Per workload: the median step time; the peak physical device memory (the
device's used memory, NVML's figure when pynvml imports, sampled every
2 ms by a thread over the whole workload, minus the figure just before the
model is built); the allocator's own peak reserved bytes
(`torch.cuda.max_memory_reserved()`, which cumem's native backend
answers); the values.
"""

import os
import statistics
import time

from workloads import RUNNERS

ALLOCATORS = ["pytorch", "expandable", "cuda_malloc_async", "cumem"]
# PYTORCH_CUDA_ALLOC_CONF per allocator. "pytorch_repeat" is PyTorch's
# allocator again: whether a workload repeats itself bit for bit at all.
# cumem's own settings come from CUMEM_CONF, passed on as it is.
PYTORCH_CONF = {"pytorch": None, "pytorch_repeat": None, "expandable": "expandable_segments:True",
                "cuda_malloc_async": "backend:cudaMallocAsync", "cumem": None}

# Sizes per scale: "tiny" checks that everything runs; "full" is the
# measurement (every workload in one process per allocator, about 25 s of
# work per process on an H100).
LLAMA = dict(hidden=1024, layers=16, heads=16, kv_heads=16, intermediate=2816, attn="eager")
# The compiled run of issue 56: a 4-layer GPT, 1024 wide, batch 8 x 512.
GPT_COMPILED = dict(hidden=1024, layers=4, heads=16, vocab=50257, positions=1024, batch=8, length=512)
LLAMA_TINY = dict(hidden=256, layers=2, heads=4, kv_heads=4, intermediate=512, attn="eager")
SCALES = {
    "full": {
        "encoder_bucketed": dict(warmup=3, steps=24, hidden=768, layers=12, heads=12, tokens=16384,
                                 buckets=[64, 128, 256, 512]),
        "seq2seq_varlen": dict(warmup=3, steps=24, d_model=512, layers=6, heads=8, batch=32, min_src=32,
                               max_src=512, min_tgt=16, max_tgt=256),
        "vit_prefetch": dict(warmup=3, steps=20, batch=64, image=224),
        "generate_padded": dict(warmup=1, steps=6, min_batch=4, max_batch=32, min_prompt=16, max_prompt=384,
                                new_tokens=24, **LLAMA),
        "gpt2_varlen": dict(warmup=3, steps=24, batch=8, min_len=64, max_len=1024),
        "resnet50": dict(warmup=3, steps=20, batch=64, image=224),
        # Generation with eager attention: with SDPA, PyTorch's own allocator
        # does not repeat its own logits bit for bit from one process to the
        # next (measured on the H100: `--workloads llama_generate
        # --allocators pytorch,pytorch_repeat`), so no allocator could be
        # checked against it.
        "llama_generate_eager": dict(warmup=8, rounds=2, new_tokens=48, batch=16, min_prompt=128, max_prompt=640,
                                     **LLAMA),
        # Not in the default list (its compile takes most of a process).
        "gpt_compiled": dict(warmup=3, steps=27, **GPT_COMPILED),
    },
    "tiny": {
        "encoder_bucketed": dict(warmup=1, steps=3, hidden=128, layers=2, heads=2, tokens=1024, buckets=[16, 64]),
        "seq2seq_varlen": dict(warmup=1, steps=3, d_model=128, layers=2, heads=2, batch=4, min_src=8, max_src=64,
                               min_tgt=8, max_tgt=32),
        "vit_prefetch": dict(warmup=1, steps=3, batch=4, image=64),
        "generate_padded": dict(warmup=1, steps=2, min_batch=2, max_batch=4, min_prompt=4, max_prompt=16,
                                new_tokens=4, **LLAMA_TINY),
        "gpt2_varlen": dict(warmup=1, steps=3, batch=2, min_len=16, max_len=128),
        "resnet50": dict(warmup=1, steps=3, batch=4, image=64),
        "llama_generate_eager": dict(warmup=2, rounds=2, new_tokens=4, batch=2, min_prompt=8, max_prompt=32,
                                     **LLAMA_TINY),
        "gpt_compiled": dict(warmup=3, steps=2, **{**GPT_COMPILED, "hidden": 128, "layers": 2, "heads": 2,
                                                    "batch": 2, "length": 64}),
    },
}
# llama_generate: the same with SDPA attention.
for _scale in SCALES.values():
    _scale["llama_generate"] = dict(_scale["llama_generate_eager"], attn="sdpa")


class PhysicalSampler:
    """Samples the device's used memory every `interval` seconds on a thread
    of its own (NVML when importable, else cudaMemGetInfo), so a peak inside
    a step is seen too. `start_phase()` takes the baseline and restarts the
    maximum; `peak()` is the largest sample since, minus that baseline.
    With NVML it also reads the SM clock every 25th sample: step times
    that differ between processes can be set beside the clock."""

    def __init__(self, torch, interval=0.002):
        import threading
        self.torch = torch
        self.interval = interval
        self.clock = None
        self.read = self._reader()
        self.start_phase()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _reader(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            index = self.torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                index = int(visible.split(",")[index])
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.source = "nvml"
            self.clock = lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used
        except Exception:  # noqa: BLE001 - any failure: the CUDA runtime's figure
            self.source = "cudaMemGetInfo"

            def read():
                f, t = self.torch.cuda.mem_get_info()
                return t - f
            return read

    def _loop(self):
        while not self.stop.is_set():
            self.high = max(self.high, self.read())
            self.count += 1
            if self.clock and self.count % 25 == 0:
                self.clocks.append(self.clock())
            self.stop.wait(self.interval)

    def start_phase(self):
        self.base = self.read()
        self.high = self.base
        self.count = 0
        self.clocks = []

    def clock_mhz(self):
        """The SM clock read every 25th sample since `start_phase()`:
        [lowest, median, highest] MHz, or None without NVML."""
        c = sorted(self.clocks)
        return [c[0], c[len(c) // 2], c[-1]] if c else None

    def peak(self):
        return max(self.high, self.read()) - self.base

    def close(self):
        self.stop.set()
        self.thread.join()


def setup(allocator):
    """A benchmark process's start: cumem installed for the cumem
    allocators (before anything touches CUDA), deterministic settings, the
    CUDA context made. Returns (torch, the cumem backend or None)."""
    if allocator.startswith("cumem"):
        import cumem_torch
        kind = cumem_torch.install()
    else:
        kind = None
    import torch

    torch.manual_seed(0)
    deterministic(torch)
    torch.cuda.init()
    torch.cuda.synchronize()
    return torch, kind


def deterministic(torch):
    """Deterministic algorithms (warnings only where there is none), no
    cuDNN benchmarking, no TF32: runs comparable bit for bit."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def run_workload(torch, sampler, workload, params, allocator, kind):
    """Runs one workload in this process, the cache emptied and the peaks
    reset first; its result (or {"error": ...}) as a dict."""
    import gc
    from workloads import StepTimes

    times, values = StepTimes(), []
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    sampler.start_phase()
    before = driver_counts(torch, kind)
    t0 = time.time()
    try:
        RUNNERS[workload](torch, params, times, values)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the other workloads still run
        import traceback
        traceback.print_exc()
        print(f"  {workload:22} {allocator:18} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"workload": workload, "allocator": allocator, "error": f"{type(e).__name__}: {e}"}
    took = time.time() - t0
    phys = sampler.peak()
    result = {
        "workload": workload,
        "allocator": allocator,
        "backend": kind,
        "device": torch.cuda.get_device_name(),
        "steps": len(times),
        "median_step_ms": statistics.median(times) * 1e3,
        "step_ms": [t * 1e3 for t in times],
        "gpu_step_ms": [t * 1e3 for t in times.gpu],
        "median_gpu_step_ms": statistics.median(times.gpu) * 1e3 if times.gpu else None,
        "peak_physical_bytes": phys,
        "samples": sampler.count,
        "sampler": sampler.source,
        "sm_clock_mhz": sampler.clock_mhz(),
        "own_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "values": [float(v).hex() for v in values],
        "workload_s": took,
    }
    if kind is not None:
        import cumem_torch
        result["cumem_pool"] = cumem_torch.stats()["pool"]
    # Driver calls (cumem: page maps/unmaps) and cumem's cross-stream
    # waits over the workload (warm-up included).
    result["counts"] = {k: v - before[k] for k, v in driver_counts(torch, kind).items()}
    print(f"  {workload:22} {allocator:18} {result['median_step_ms']:8.2f} ms  phys {mib(phys):>7} MiB "
          f"peak allocated {mib(result['peak_allocated_bytes']):>7} MiB ({sampler.count} samples, {took:.1f} s) "
          f"{' '.join(f'{k}={v}' for k, v in result['counts'].items())}", flush=True)
    return result


def driver_counts(torch, kind):
    """Device allocation/free calls so far (PyTorch's statistics; with
    cumem: page maps and unmaps) and, with cumem, its cross-stream waits."""
    m = torch.cuda.memory_stats()
    c = {"device_allocs": m.get("num_device_alloc", 0), "device_frees": m.get("num_device_free", 0)}
    if kind is not None:
        import cumem_torch
        st = cumem_torch.stats()
        c["stream_waits"] = st["stream_waits"]
        c["waits_elided"] = st["stream_waits_elided"]
        c["move_waits"] = st.get("move_waits", -1)
    return c


def env_for(allocator):
    """The environment of a benchmark process of `allocator` (SystemExit for
    an unknown one)."""
    if allocator not in PYTORCH_CONF:
        raise SystemExit(f"unknown allocator {allocator} (known: {', '.join(PYTORCH_CONF)})")
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if PYTORCH_CONF[allocator]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = PYTORCH_CONF[allocator]
    return env


def mib(b):
    return f"{b / 2**20:,.0f}"
