#!/usr/bin/env python3
"""Same program, same peak: one var-length training workload
(real_workloads.py's encoder_bucketed at its full scale: a BERT-base
encoder on length-bucketed batches, 3 + 24 steps) in two fresh processes
under cumem; both must reach the same peak:

- cumem's own peak reserved bytes (`torch.cuda.max_memory_reserved()`,
  answered by its native backend) equal, to the byte;
- the peak physical device memory (NVML, sampled every 2 ms by a thread,
  real_workloads.py's PhysicalSampler) within 0.5%.

Control: a third process runs the same workload 5% larger (tokens per
batch); the same comparison must find it different (reserved bytes not
equal and the physical peak more than 0.5% away), or the check could not
see a difference at all.

cumem_torch comes from the wheel given as the argument, else
.whl/cumem_torch-*.whl of the checkout (scripts/ddp.sh build makes it),
installed into a temporary folder; else from the Python running this.
Needs PyTorch with a CUDA device and transformers: without them it says
so and exits 0, unless CUMEM_REQUIRE_GPU=1 (then it fails)."""

import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REQUIRE = os.environ.get("CUMEM_REQUIRE_GPU") == "1"


def skip(why):
    print(("FAILED: " if REQUIRE else "skipped: ") + why)
    sys.exit(1 if REQUIRE else 0)


try:
    import torch
    from transformers import BertForMaskedLM  # noqa: F401 - the workload's model
except ImportError as e:
    torch = None
    skip(f"PyTorch and transformers are needed ({e})")
if not torch.cuda.is_available():
    skip("a CUDA device is needed")

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCH = REPO / "python" / "bench"
sys.path.insert(0, str(BENCH))
import real_workloads  # noqa: E402

MIB = 1 << 20
WORKLOAD = "encoder_bucketed"
TOLERANCE = 0.005
tmp = pathlib.Path(tempfile.mkdtemp(prefix="cumem-same-peak-"))

wheels = sys.argv[1:] or sorted(glob.glob(str(REPO / ".whl" / "cumem_torch-*.whl")))
pythonpath = [str(BENCH)]
if wheels:
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(site), wheels[0]], check=True)
    pythonpath.insert(0, str(site))
    print("cumem_torch from", wheels[0])
else:
    try:
        import cumem_torch
    except ImportError:
        sys.exit("FAILED: no wheel (give its path, or scripts/ddp.sh build) and no cumem_torch installed")
    print("cumem_torch from", os.path.dirname(cumem_torch.__file__))
env = real_workloads.env_for("cumem")
env.pop("CUMEM_CONF", None)
env["PYTHONPATH"] = os.pathsep.join(pythonpath + [p for p in [os.environ.get("PYTHONPATH")] if p])

# The native backend compiled (once) and loaded before the measured
# processes, so that neither pays for it.
r = subprocess.run([sys.executable, "-c", "from cumem_torch import _native; print(_native.library()._name)"],
                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
if r.returncode != 0:
    sys.exit(f"FAILED: cumem's native backend did not build or load:\n{r.stdout[-3000:]}")
print("native backend:", r.stdout.strip().splitlines()[-1])


def run(name, params):
    """One fresh process (steptime.py's child) running the workload under
    cumem; its result."""
    out = tmp / f"{name}.json"
    req = {"workloads": [[WORKLOAD, params]], "out": str(out)}
    p = subprocess.run([sys.executable, str(BENCH / "steptime.py"), "--child", "cumem", json.dumps(req)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    if p.returncode != 0 or not out.exists():
        sys.exit(f"FAILED: process {name} failed (exit {p.returncode}):\n{p.stdout[-4000:]}")
    res = json.loads(out.read_text())[0]
    if "error" in res:
        sys.exit(f"FAILED: process {name}: {res['error'][:2000]}")
    if res.get("backend") != "native":
        sys.exit(f"FAILED: process {name} ran cumem's {res.get('backend')} backend, not the native one")
    print(f"{name}: peak physical {res['peak_physical_bytes'] / MIB:,.1f} MiB ({res['samples']} samples, "
          f"{res['sampler']}), own peak reserved {res['own_peak_reserved_bytes']:,} B, peak allocated "
          f"{res['peak_allocated_bytes']:,} B, median step {res['median_step_ms']:.2f} ms")
    return res


def same(a, b):
    """(reserved equal, physical peaks within TOLERANCE, their gap)."""
    pa, pb = a["peak_physical_bytes"], b["peak_physical_bytes"]
    gap = abs(pa - pb) / min(pa, pb)
    return a["own_peak_reserved_bytes"] == b["own_peak_reserved_bytes"], gap <= TOLERANCE, gap


params = dict(real_workloads.SCALES["full"][WORKLOAD])
first, second = run("A", params), run("B", params)
larger = run("control", dict(params, tokens=params["tokens"] * 105 // 100))

failed = []
reserved_equal, physical_close, gap = same(first, second)
print(f"A and B: own peak reserved {'equal' if reserved_equal else 'DIFFERENT'}, peak physical {gap * 100:.3f}% apart")
if not reserved_equal:
    failed.append(f"cumem's peak reserved differs between two processes of one program: "
                  f"{first['own_peak_reserved_bytes']:,} / {second['own_peak_reserved_bytes']:,} B")
if not physical_close:
    failed.append(f"the peak physical memory of two processes of one program is {gap * 100:.3f}% apart "
                  f"(at most {TOLERANCE * 100}%)")
if first["values"] != second["values"]:
    print("note: the two processes' losses differ (not part of this test)")

c_reserved, c_close, c_gap = same(first, larger)
print(f"control (5% more tokens): own peak reserved {'equal' if c_reserved else 'different'}, "
      f"peak physical {c_gap * 100:.3f}% apart")
if c_reserved or c_close:
    failed.append("control: a 5% larger workload passed as the same peak; the comparison can't see a difference")

if failed:
    print("\n".join("FAILED: " + f for f in failed))
    sys.exit(1)
print("smoke_same_peak: ok")
