"""The probes of `fit.py` (and the ballast `steptime.py` shares): each a
process of its own, forked from a server per allocator or spawned.

A probe makes its CUDA context (cumem installed first where the allocator
is cumem), takes a ballast that leaves the budget free (`cuMemAlloc`
straight from the driver, so no allocator sees it: like another process's
memory), runs the workload at the size it is given and says whether it
fitted: no `torch.cuda.OutOfMemoryError` (nor an error whose message says
the memory ran out, such as cuBLAS's CUBLAS_STATUS_ALLOC_FAILED). Any
other error is reported as one.

The ballast is in two parts: a holder process (`Holder`) takes all but
the budget and a few GiB for the whole run, and each probe takes the rest
itself, after its context is made; the driver takes seconds to map and
unmap most of a device, a few GiB it takes at once.

A probe server (`zygote`) imports PyTorch and transformers with its
allocator's environment (PYTORCH_CUDA_ALLOC_CONF is read when PyTorch
loads) and never touches CUDA; it forks a probe for each request, so each
probe is a fresh process with a fresh CUDA context that does not pay for
the imports (about 5-10 s). `Runner` drives the servers, or spawns new
interpreters (`spawn`, or for an allocator whose forked probe failed where
a new interpreter did not).
"""

import json
import os
import select
import signal
import subprocess
import sys
import time

import real_workloads

GIB = 1 << 30
MIB = 1 << 20
# The holder leaves this much more than the budget free: a probe's context
# and libraries come out of it, and the probe's own ballast takes the rest.
HOLD_SLACK_GIB = 3
HERE = os.path.abspath(__file__)


class Ballast:
    """Device memory taken straight from the driver (`cuMemAlloc_v2`, in
    pieces of at most 16 GiB, on the calling thread's current context),
    held until the process ends: no allocator sees it."""

    def __init__(self, nbytes):
        import ctypes
        self.bytes = 0
        cuda = ctypes.CDLL("libcuda.so.1") if nbytes > 0 else None
        while self.bytes < nbytes:
            piece = min(16 * GIB, nbytes - self.bytes)
            ptr = ctypes.c_uint64()
            rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(piece))
            if rc != 0:
                raise RuntimeError(f"ballast: cuMemAlloc_v2 of {piece} B failed with CUresult {rc} "
                                   f"after {self.bytes} B")
            self.bytes += piece


def read_line(proc, timeout):
    """A line of `proc`'s output, or "" when none came in `timeout` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def stop(proc, timeout):
    """Closes `proc`'s input (its sign to end), waits `timeout` s, kills it."""
    proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


class Holder:
    """The ballast's bulk: a process of its own (`probes.py --hold`) that
    takes all of the device's free memory but `leave` bytes (a Ballast on
    its own context) until `close()`."""

    def __init__(self, leave):
        self.proc = subprocess.Popen([sys.executable, HERE, "--hold", str(leave)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = read_line(self.proc, 120)
        if not line.startswith("{"):
            self.close()
            raise SystemExit("the memory holder (probes.py --hold) did not start")
        self.info = json.loads(line)

    def close(self):
        stop(self.proc, 60)


def hold(leave):
    """`--hold`: the driver API alone (no PyTorch), device 0's primary
    context; holds its ballast until standard input closes."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(rc, what):
        if rc != 0:
            raise SystemExit(f"hold: {what} failed with CUresult {rc}")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    ballast = Ballast(max(0, free.value - leave) // (2 * MIB) * (2 * MIB))
    print(json.dumps({"held": ballast.bytes, "free_before": free.value, "total": total.value}), flush=True)
    sys.stdin.read()


def leave_free(torch, want, expect_free=None, wait_s=20.0):
    """Takes a ballast that leaves `want` bytes of the device free, after
    waiting (up to `wait_s`) for `expect_free` to be free: the last probe's
    process may still be giving memory back. Returns a dict of what it saw."""
    t0 = time.time()
    free, total = torch.cuda.mem_get_info()
    while expect_free and free < expect_free and time.time() - t0 < wait_s:
        time.sleep(0.2)
        free, total = torch.cuda.mem_get_info()
    seen = {"free_before": free, "total": total, "waited_s": round(time.time() - t0, 2)}
    if expect_free and free < expect_free:
        raise RuntimeError(f"only {free / GIB:.2f} GiB free after {wait_s:.0f} s (another process holds "
                           f"memory; {expect_free / GIB:.2f} GiB were free before)")
    if free < want:
        raise RuntimeError(f"only {free / GIB:.2f} GiB free: --free-gib asks for {want / GIB:.2f}")
    # Rounded down to the driver's 2 MiB pages: at least `want` stays free.
    seen["ballast"] = Ballast((free - want) // (2 * MIB) * (2 * MIB))
    seen["free_after"] = torch.cuda.mem_get_info()[0]
    return seen


def ran_out(e):
    """Whether an exception (or one in its chain) says the device memory
    ran out: the kind of it, or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "OutOfMemoryError":
            return "OutOfMemoryError"
        text = str(e)
        for mark in ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                     "cudaErrorMemoryAllocation", "CUDA_ERROR_OUT_OF_MEMORY"):
            if mark in text:
                return mark
        e = e.__cause__ or e.__context__
    return None


def probe(allocator, req):
    """One probe, in a process of its own: runs req["workload"] with
    req["params"] in req["free_bytes"] of free device memory and writes
    its result to req["out"]."""
    from workloads import RUNNERS
    res = {"workload": req["workload"], "allocator": allocator, "n": req.get("n"), "pid": os.getpid()}
    t0 = time.time()
    try:
        torch, res["backend"] = real_workloads.setup(allocator)
        seen = leave_free(torch, req["free_bytes"], req.get("expect_free"))
        ballast = seen.pop("ballast")  # held until the probe ends
        res.update(seen, ballast_bytes=ballast.bytes, device=torch.cuda.get_device_name())
        t1 = time.time()
        values = []
        try:
            RUNNERS[req["workload"]](torch, req["params"], [], values)
            torch.cuda.synchronize()
            res["fits"] = True
        except Exception as e:  # noqa: BLE001 - out of memory is an answer, anything else an error
            kind = ran_out(e)
            if kind is None:
                raise
            res["fits"] = False
            res["oom"] = f"{kind}: {str(e)[:400]}"
        res["workload_s"] = round(time.time() - t1, 2)
        res["steps_run"] = len(values)
        res["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        res["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    except Exception as e:  # noqa: BLE001 - reported, and the search stops
        import traceback
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
    res["process_s"] = round(time.time() - t0, 2)
    with open(req["out"], "w") as f:
        json.dump(res, f)


# The transformers classes of fit.py's workloads, imported by a probe server.
MODEL_CLASSES = ("BertForMaskedLM", "T5ForConditionalGeneration", "GPT2LMHeadModel", "LlamaForCausalLM")


def zygote(allocator):
    """The probe server of one allocator: imports what the probes need, forks
    a probe per request line on stdin, answers its exit status on stdout."""
    import torch
    import transformers
    import workloads  # noqa: F401 - imported once, for every fork
    for name in MODEL_CLASSES:
        getattr(transformers, name)
    threads = len(os.listdir("/proc/self/task"))
    print(json.dumps({"ready": True, "torch": torch.__version__, "cuda_initialized": torch.cuda.is_initialized(),
                      "threads": threads}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with open(req["log"], "w") as log:
                    os.dup2(log.fileno(), 1)
                    os.dup2(log.fileno(), 2)
                probe(allocator, req)
                code = 0
            except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
                import traceback
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        print(json.dumps({"rc": wait_child(pid, req["timeout"])}), flush=True)


def wait_child(pid, timeout):
    """The exit code of child `pid`, killed (-9) after `timeout` seconds."""
    end = time.time() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.time() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.05)


# --------------------------------------------------------------- driver --

def env_of(allocator):
    """The allocator's environment (real_workloads.env_for). Anything in a
    probe server that asks whether CUDA is there asks NVML, which leaves
    CUDA untouched for the forks."""
    return dict(real_workloads.env_for(allocator), PYTORCH_NVML_BASED_CUDA_CHECK="1")


def settings(allocator):
    """The allocator's settings in its environment, for a dry run's plan."""
    env = real_workloads.env_for(allocator)
    return {k: env[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUMEM_CONF") if k in env} or "no allocator settings"


class Runner:
    """Runs probes, forked or spawned (module docs); logs, results: `outdir`."""

    def __init__(self, allocators, outdir, spawn, free_bytes, timeout):
        self.outdir, self.free_bytes, self.timeout = outdir, free_bytes, timeout
        self.spawned = set(allocators) if spawn else set()
        self.trusted = set()  # allocators whose server gave a probe without error
        self.servers = {al: self._server(al) for al in allocators if al not in self.spawned}
        self.count = 0
        self.most_free = 0
        for al, srv in self.servers.items():
            line = read_line(srv, 600)
            ready = json.loads(line) if line.startswith("{") else {}
            if not ready.get("ready"):
                raise SystemExit(f"the probe server of {al} did not start (log: {srv.log})")
            print(f"probe server {al}: torch {ready['torch']}, {ready['threads']} threads, "
                  f"CUDA initialised: {ready['cuda_initialized']}", flush=True)
            if ready["cuda_initialized"]:
                raise SystemExit(f"the probe server of {al} initialised CUDA before forking")

    def _server(self, al):
        log = os.path.join(self.outdir, f"server-{al}.log")
        with open(log, "w") as err:
            srv = subprocess.Popen([sys.executable, HERE, "--zygote", al], env=env_of(al), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        srv.log = log
        return srv

    def ask(self, al, workload, n, params):
        """Probes `workload` with `params` (`n`: the size, for the names):
        the probe's result, with "fits" or "error"."""
        self.count += 1
        base = os.path.join(self.outdir, f"{self.count:03d}-{workload}-{al}-{n}")
        req = {"workload": workload, "n": n, "params": params, "free_bytes": self.free_bytes,
               "expect_free": self.most_free - GIB if self.most_free else None, "timeout": self.timeout,
               "out": base + ".json", "log": base + ".log"}
        how = "spawn" if al in self.spawned else "fork"
        res = self._run(al, req, how)
        if how == "fork" and "error" in res and al not in self.trusted:
            print(f"   {al}: a forked probe failed ({res['error'][:200]}); trying a new interpreter", flush=True)
            again = self._run(al, dict(req, out=base + "-spawn.json", log=base + "-spawn.log"), "spawn")
            if "error" not in again:
                print(f"   {al}: a new interpreter did not fail: spawning {al}'s probes from now on", flush=True)
                self.spawned.add(al)
                res = again
        elif how == "fork" and "error" not in res:
            self.trusted.add(al)
        self.most_free = max(self.most_free, res.get("free_before", 0))
        res["how"] = "spawn" if al in self.spawned else how
        return res

    def _run(self, al, req, how):
        t0 = time.time()
        rc = None
        if how == "fork":
            srv = self.servers[al]
            srv.stdin.write(json.dumps(req) + "\n")
            srv.stdin.flush()
            line = read_line(srv, req["timeout"] + 60)
            rc = json.loads(line)["rc"] if line.startswith("{") else None
        else:
            with open(req["log"], "w") as log:
                try:
                    rc = subprocess.run([sys.executable, HERE, "--probe", al, json.dumps(req)], env=env_of(al),
                                        stdout=log, stderr=subprocess.STDOUT, timeout=req["timeout"]).returncode
                except subprocess.TimeoutExpired:
                    rc = -9
        res = {}
        if os.path.exists(req["out"]):
            with open(req["out"]) as f:
                res = json.load(f)
        if "fits" not in res and "error" not in res:
            tail = open(req["log"]).read()[-1500:] if os.path.exists(req["log"]) else ""
            res["error"] = f"the probe ended with {rc} and no result (log {req['log']}): {tail}"
        res["wall_s"] = round(time.time() - t0, 2)
        return res

    def close(self):
        for srv in self.servers.values():
            stop(srv, 30)


def prepare_cumem(allocators):
    """cumem's native backend, compiled (once, into its cache) and loaded in
    a process of its own, so no probe pays for the compile."""
    for al in allocators:
        if al.startswith("cumem"):
            code = "from cumem_torch import _native; print('cumem native backend:', _native.library()._name)"
            r = subprocess.run([sys.executable, "-c", code], env=env_of(al), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=900)
            print(r.stdout.strip()[-2000:], flush=True)
            if r.returncode != 0:
                raise SystemExit(f"cumem's native backend failed to build or load for {al}")
            return


def main():
    import argparse
    ap = argparse.ArgumentParser(description="fit.py's and steptime.py's processes (not run by hand)")
    ap.add_argument("--hold", type=int, metavar="BYTES", help="hold all of the device's memory but BYTES")
    ap.add_argument("--zygote", metavar="ALLOCATOR", help="a probe server")
    ap.add_argument("--probe", nargs=2, metavar=("ALLOCATOR", "REQUEST"), help="one probe (a JSON request)")
    a = ap.parse_args()
    if a.hold is not None:
        hold(a.hold)
    elif a.zygote:
        zygote(a.zygote)
    elif a.probe:
        probe(a.probe[0], json.loads(a.probe[1]))
    else:
        ap.error("one of --hold, --zygote, --probe")


if __name__ == "__main__":
    main()
