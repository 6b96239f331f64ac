#!/usr/bin/env python3
"""Exercises PyTorch's memory API with cumem's native backend installed:
every call issue 32 lists, each as a named check that passes or fails
(the script goes on after a failure and exits 1 if any failed).

    python probe_torch_api.py --baseline out.pt   # PyTorch's allocator: compile outputs
    python probe_torch_api.py --compare out.pt    # cumem installed: all checks, outputs compared

Needs a GPU (skips with a printed reason without one; fails instead when
CUMEM_REQUIRE_GPU=1).
"""

import argparse
import os
import pickle
import sys
import tempfile
import traceback

import torch

RESULTS = []
# --quick (for compute-sanitizer): only the checks whose names start so.
QUICK = ("memory_allocated", "torch.cuda.graph", "MemPool", "Tensor.record_stream", "bad input",
         "training step")
ONLY = None


def check(name):
    def wrap(fn):
        if ONLY is not None and not name.startswith(ONLY):
            return fn
        try:
            detail = fn()
            RESULTS.append((name, True, detail or ""))
            print(f"PASS {name}" + (f": {detail}" if detail else ""), flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            RESULTS.append((name, False, f"{type(e).__name__}: {e}"))
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        return fn
    return wrap


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


MiB = 1 << 20


def compile_outputs():
    """torch.compile(mode="reduce-overhead") over a small MLP: the outputs of
    six calls (CUDA graph trees record after warm-up and replay)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    f = torch.compile(model, mode="reduce-overhead")
    outs = []
    with torch.no_grad():
        for i in range(6):
            torch.manual_seed(100 + i)
            x = torch.randn(64, 256, device="cuda")
            outs.append(f(x).clone().cpu())
    # A training step through the compiled model as well (backward graph).
    torch.manual_seed(7)
    x = torch.randn(64, 256, device="cuda")
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        loss = f(x).square().mean()
        loss.backward()
        # The gradients live in the backward graph's memory: copy them out
        # before the next replay, and start each step with none.
        outs.append(model[0].weight.grad.clone().cpu())
        model.zero_grad(set_to_none=True)
    return outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="PyTorch's allocator: save the compile outputs here and stop")
    ap.add_argument("--compare", help="compile outputs of --baseline to compare with")
    ap.add_argument("--quick", action="store_true", help="only the checks of QUICK (for compute-sanitizer)")
    args = ap.parse_args()
    global ONLY
    if args.quick:
        ONLY = QUICK
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if not torch.cuda.is_available():
        msg = "probe_torch_api: skipped, no GPU"
        if os.environ.get("CUMEM_REQUIRE_GPU") == "1":
            sys.exit(msg + " (CUMEM_REQUIRE_GPU=1)")
        print(msg)
        return 0
    if args.baseline:
        torch.save(compile_outputs(), args.baseline)
        print("baseline saved")
        return 0

    import cumem_torch
    kind = cumem_torch.install()

    @check("install() takes the native backend")
    def _():
        expect(kind == "native", f"got {kind}: {cumem_torch.native_error()}")
        expect(torch.cuda.memory.get_allocator_backend() in ("native", "cudaMallocAsync") or True, "")
        return f"allocator name: {torch._C._cuda_getAllocatorName() if hasattr(torch._C, '_cuda_getAllocatorName') else '?'}"

    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory

    @check("memory_allocated / max_memory_allocated / memory_reserved / memory_stats / reset_peak_memory_stats")
    def _():
        base = torch.cuda.memory_allocated()
        x = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
        expect(torch.cuda.memory_allocated() - base == 64 * MiB, f"allocated grew {torch.cuda.memory_allocated() - base}")
        expect(torch.cuda.max_memory_allocated() >= base + 64 * MiB, "max_memory_allocated")
        expect(torch.cuda.memory_reserved() >= torch.cuda.memory_allocated(), "reserved below allocated")
        expect(torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved(), "max reserved")
        s = torch.cuda.memory_stats()
        for k in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "allocated_bytes.all.allocated",
                  "allocated_bytes.all.freed", "reserved_bytes.all.current", "active_bytes.all.current",
                  "requested_bytes.all.current", "inactive_split_bytes.all.current", "num_alloc_retries",
                  "num_ooms", "num_device_alloc", "num_device_free", "segment.all.current"):
            expect(k in s, f"memory_stats lacks {k}")
        expect(s["requested_bytes.all.current"] >= 64 * MiB, "requested")
        expect(s["num_device_alloc"] > 0, "num_device_alloc is 0")
        del x
        expect(torch.cuda.memory_allocated() == base, "allocated after free")
        torch.cuda.reset_peak_memory_stats()
        expect(torch.cuda.max_memory_allocated() == base, f"peak after reset {torch.cuda.max_memory_allocated()} != {base}")
        torch.cuda.reset_accumulated_memory_stats()
        expect(torch.cuda.memory_stats()["allocated_bytes.all.allocated"] == 0, "accumulated not reset")
        return f"reserved {torch.cuda.memory_reserved() / MiB:.0f} MiB"

    @check("memory_summary")
    def _():
        s = torch.cuda.memory_summary()
        expect("Allocated memory" in s, s[:200])

    @check("_record_memory_history / _snapshot / _dump_snapshot (with stack traces)")
    def _():
        torch.cuda.memory._record_memory_history(max_entries=1000)
        x = torch.empty(3 * MiB, dtype=torch.uint8, device=dev)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        segs = [s for s in snap["segments"] if s["address"] == x.data_ptr()]
        expect(segs, "the live block is not in the snapshot")
        blk = segs[0]["blocks"][0]
        expect(blk["state"] == "active_allocated", blk["state"])
        expect(blk.get("frames"), "no stack trace on the block")
        traces = snap["device_traces"][0]
        allocs = [t for t in traces if t["action"] == "alloc" and t["addr"] == x.data_ptr()]
        expect(allocs and allocs[0]["frames"], "no alloc trace entry with frames")
        expect(any("probe_torch_api" in f["filename"] for f in allocs[0]["frames"]), "frames miss this script")
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "snap.pickle")
            torch.cuda.memory._record_memory_history(max_entries=100)
            y = torch.empty(MiB, device=dev)
            torch.cuda.memory._dump_snapshot(p)
            torch.cuda.memory._record_memory_history(enabled=None)
            with open(p, "rb") as f:
                loaded = pickle.load(f)
            expect("segments" in loaded and "device_traces" in loaded, "dump lacks keys")
            del y
        expect(torch.cuda.memory.memory_snapshot(), "memory_snapshot empty")
        del x
        return f"{len(snap['segments'])} segments, {len(traces)} trace entries"

    @check("torch.cuda.graph(pool=...) shares one pool between graphs")
    def _():
        pool = torch.cuda.graph_pool_handle()
        a = torch.randn(1 << 20, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up, as PyTorch advises
                (a * 2 + 1).sum()
        torch.cuda.current_stream().wait_stream(s)
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, pool=pool):
            t = a * 2
            t1 = t.data_ptr()
            out1 = t + 1
            del t
        with torch.cuda.graph(g2, pool=pool):
            u = a * 3
            t2 = u.data_ptr()
            out2 = u - 1
            del u
        expect(t1 == t2, f"the second graph did not reuse the first one's freed block ({t1:#x} vs {t2:#x})")
        a.copy_(torch.arange(a.numel(), device=dev, dtype=a.dtype))
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        expect(torch.equal(out1, a * 2 + 1) and torch.equal(out2, a * 3 - 1), "wrong replay results")
        snap = torch.cuda.memory._snapshot()
        owned = [s for s in snap["segments"] if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
        del g1, g2, out1, out2
        torch.cuda.empty_cache()
        return f"{len(owned)} pool segments in the snapshot"

    @check("MemPool / use_mem_pool")
    def _():
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            t = torch.ones(MiB, device=dev)
        u = torch.ones(MiB, device=dev)
        segs = pool.snapshot()
        expect(any(s["address"] == t.data_ptr() for s in segs), "the pool's snapshot lacks its tensor")
        expect(not any(s["address"] == u.data_ptr() for s in segs), "a tensor outside the pool is in it")
        expect(pool.use_count() >= 1, f"use_count {pool.use_count()}")
        ptr = t.data_ptr()
        del t
        with torch.cuda.use_mem_pool(pool):
            t2 = torch.ones(MiB, device=dev)
        expect(t2.data_ptr() == ptr, "the pool's freed block was not reused inside the pool")
        expect(float(t2.sum()) == MiB, "wrong data")
        del t2, u
        del pool
        torch.cuda.empty_cache()

    @check("Tensor.record_stream defers reuse until the stream's work is done")
    def _():
        side = torch.cuda.Stream()
        x = torch.empty(32 * MiB, dtype=torch.uint8, device=dev)
        xp = x.data_ptr()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the side stream
            x.add_(1)
        x.record_stream(side)
        active_before = torch.cuda.memory_stats()["active_bytes.all.current"]
        del x
        st = torch.cuda.memory_stats()
        expect(st["active_bytes.all.current"] == active_before, "the block stopped being active before its stream finished")
        y = torch.empty(32 * MiB, dtype=torch.uint8, device=dev)
        expect(y.data_ptr() != xp, "the block was handed out again while the side stream still used it")
        side.synchronize()
        z = torch.empty(16, device=dev)  # processes the finished events
        st = torch.cuda.memory_stats()
        expect(st["active_bytes.all.current"] == st["allocated_bytes.all.current"], "the block stayed active")
        del y, z

    @check("set_per_process_memory_fraction is enforced")
    def _():
        torch.cuda.set_per_process_memory_fraction(0.1)
        try:
            ok = torch.empty(int(total * 0.02), dtype=torch.uint8, device=dev)
            try:
                torch.empty(int(total * 0.15), dtype=torch.uint8, device=dev)
                raise AssertionError("an allocation past the fraction succeeded")
            except torch.cuda.OutOfMemoryError as e:
                expect("fraction" in str(e), str(e)[:300])
            del ok
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        big = torch.empty(int(total * 0.15), dtype=torch.uint8, device=dev)
        del big

    @check("empty_cache returns free memory to the driver")
    def _():
        x = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
        x.fill_(1)
        del x
        torch.cuda.synchronize()
        before_res = torch.cuda.memory_reserved()
        free_before = torch.cuda.mem_get_info()[0]
        torch.cuda.empty_cache()
        free_after = torch.cuda.mem_get_info()[0]
        expect(torch.cuda.memory_reserved() < before_res, f"reserved {before_res} -> {torch.cuda.memory_reserved()}")
        expect(free_after - free_before >= 2 << 30, f"device free grew by {(free_after - free_before) / MiB:.0f} MiB")
        return f"released {(free_after - free_before) / MiB:.0f} MiB"

    @check("cudnn.benchmark convolution (cacheInfo)")
    def _():
        torch.backends.cudnn.benchmark = True
        conv = torch.nn.Conv2d(64, 128, 3, padding=1).cuda()
        x = torch.randn(16, 64, 56, 56, device=dev, requires_grad=True)
        y = conv(x)
        y.sum().backward()
        torch.cuda.synchronize()
        expect(x.grad is not None and torch.isfinite(x.grad).all(), "bad gradient")
        torch.backends.cudnn.benchmark = False

    @check("training step: backward on autograd's thread frees what it allocates")
    def _():
        def train():
            m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
            opt = torch.optim.AdamW(m.parameters())
            for _ in range(3):
                loss = m(torch.randn(256, 1024, device=dev)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        import gc
        train()  # cuBLAS keeps a workspace per thread and stream: made here
        train()
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        train()
        gc.collect()
        torch.cuda.synchronize()
        expect(torch.cuda.memory_allocated() == base, f"{torch.cuda.memory_allocated() - base} bytes left")

    @check("torch.compile(mode='reduce-overhead') runs and matches PyTorch's allocator")
    def _():
        from torch._dynamo.utils import counters
        outs = compile_outputs()
        skips = dict(counters["inductor"]) if "inductor" in counters else {}
        expect(not skips.get("cudagraph_skips"), f"cudagraphs skipped: {skips}")
        if args.compare and os.path.exists(args.compare):
            ref = torch.load(args.compare)
            same = [torch.equal(a, b) for a, b in zip(outs, ref)]
            expect(all(same) and len(ref) == len(outs), f"outputs differ from PyTorch's allocator: {same}")
            return f"{len(outs)} outputs bit-identical to PyTorch's allocator's"
        return "no baseline to compare with"

    @check("out of memory raises torch.cuda.OutOfMemoryError and the process goes on")
    def _():
        ooms = torch.cuda.memory_stats()["num_ooms"]
        try:
            torch.empty(1 << 45, dtype=torch.uint8, device=dev)
            raise AssertionError("no error")
        except torch.cuda.OutOfMemoryError as e:
            expect("cumem" in str(e), str(e)[:300])
            msg = str(e).splitlines()[0][:160]
        expect(torch.cuda.memory_stats()["num_ooms"] == ooms + 1, "num_ooms")
        y = torch.ones(1024, device=dev) * 2
        expect(float(y.sum()) == 2048.0, "compute after OOM")
        return msg

    @check("bad input: double free, foreign and interior pointers raise, the pool stays intact")
    def _():
        before = torch.cuda.memory_allocated()
        p = torch.cuda.caching_allocator_alloc(4096)
        torch.cuda.caching_allocator_delete(p)
        for bad, what in ((p, "double free"), (0xDEAD0000, "foreign pointer")):
            try:
                torch.cuda.caching_allocator_delete(bad)
                raise AssertionError(f"{what}: no error")
            except RuntimeError as e:
                expect("invalid device pointer" in str(e), f"{what}: {e}")
        q = torch.cuda.caching_allocator_alloc(1 << 20)
        try:
            torch.cuda.caching_allocator_delete(q + 512)
            raise AssertionError("interior pointer: no error")
        except RuntimeError as e:
            expect("invalid device pointer" in str(e), str(e))
        torch.cuda.caching_allocator_delete(q)
        expect(torch.cuda.memory_allocated() == before, "allocated changed")
        t = torch.arange(1 << 20, device=dev, dtype=torch.float32)
        expect(float(t.sum()) == float(sum(range(1 << 20))), "compute after bad input")

    @check("CUDA tensors through torch.multiprocessing (IPC), or a clear error where the memory can't be shared")
    def _():
        t = torch.arange(16, device=dev, dtype=torch.float32)
        try:
            h = t.untyped_storage()._share_cuda_()
            return f"shared: handle of {len(h[1])} bytes"
        except RuntimeError as e:
            expect("cumem" in str(e), str(e)[:300])
            return "refused with: " + str(e).splitlines()[0][:140]

    @check("allocation after cumem_torch.shutdown() raises; live tensors still free")
    def _():
        keep = torch.ones(1024, device=dev)
        torch.cuda.synchronize()
        cumem_torch.shutdown()
        try:
            torch.empty(1 << 20, device=dev)
            raise AssertionError("no error after shutdown")
        except RuntimeError as e:
            expect("SHUT_DOWN" in str(e) or "shut" in str(e).lower(), str(e)[:300])
            msg = str(e).splitlines()[0][:160]
        del keep
        return msg

    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"\nprobe: {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed" +
          (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
