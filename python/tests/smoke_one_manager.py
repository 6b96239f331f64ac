#!/usr/bin/env python3
"""One cumem manager per process with the native backend compiled on
first use and shared by two installs (the bug: the cached library, linked
against install A's libcumem_c.so, loaded A's copy beside install B's, and
Python's calls and PyTorch's allocations reached two managers).

The wheel (the argument, else .whl/cumem_torch-*.whl of the checkout) goes
into folders A and B with `pip install --no-deps --no-index --target`,
without its packaged native library (as from a wheel built without
PyTorch), so that `install()` compiles one into CUMEM_TORCH_CACHE (a fresh
folder). Each step is a process of its own:

1. from A: compiles into the cache; cumem installed, one libcumem_c.so
   mapped (A's), a tensor seen by `stats()` and a tagged one by
   `tag_usage()`;
2. from B, same cache: no compile (one build of cumem, one key), and the
   same checks with B's copy, or install() refuses with the error naming
   both files;
3. control, from B with A's copy loaded first into the global scope: the
   native library's calls reach A's copy, and install() must refuse,
   naming both, and install nothing;
4. from C, whose libcumem_c.so differs (bytes appended): a second build in
   the cache, and the same checks with C's copy.

Exits non-zero on the first wrong result. Needs PyTorch, a GPU and a C++
compiler (it says so and exits 0 where there is no PyTorch with a GPU,
unless CUMEM_REQUIRE_GPU=1)."""

import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    torch = None
if torch is None or not torch.cuda.is_available():
    print("skipped: PyTorch with a CUDA device is needed")
    sys.exit(1 if os.environ.get("CUMEM_REQUIRE_GPU") == "1" else 0)

REPO = pathlib.Path(__file__).resolve().parents[2]
wheels = sys.argv[1:] or sorted(glob.glob(str(REPO / ".whl" / "cumem_torch-*.whl")))
if not wheels:
    sys.exit(f"FAILED: no wheel (give its path, or put it in {REPO / '.whl'}: scripts/ddp.sh build)")
WHEEL = wheels[0]
tmp = pathlib.Path(tempfile.mkdtemp(prefix="cumem-one-manager-"))
CACHE = tmp / "cache"
MIB = 1 << 20

CHILD = r"""
import ctypes, json, os, sys
pre = os.environ.get("ONE_MANAGER_PRELOAD")
if pre:
    ctypes.CDLL(pre, mode=ctypes.RTLD_GLOBAL)
import torch
import cumem_torch
from cumem_torch import _native
out = {"package": os.path.realpath(os.path.dirname(cumem_torch.__file__))}
try:
    out["backend"] = cumem_torch.install()
except RuntimeError as e:
    out["error"] = str(e)
    out["installed"] = cumem_torch.is_installed()
    print(json.dumps(out))
    sys.exit(0)
out["native_error"] = cumem_torch.native_error()
x = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
with cumem_torch.tag("weights"):
    w = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
out["native"] = os.path.realpath(_native._lib_native._name) if _native._lib_native is not None else None
out["copies"] = [os.path.realpath(p) for p in _native.loaded_copies()]
out["in_use"] = cumem_torch.stats()["pool"]["in_use"]
out["tags"] = {t["name"]: t["in_use"] for t in cumem_torch.tag_usage()}
out["torch_allocated"] = torch.cuda.memory_allocated()
print(json.dumps(out))
"""


def install(folder):
    """The wheel in tmp/folder, without the packaged native library."""
    target = tmp / folder
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(target), WHEEL], check=True)
    pkg = target / "cumem_torch"
    for f in ("libcumem_torch_native.so", "native_torch.txt"):
        if (pkg / f).exists():
            (pkg / f).unlink()
    return pkg


def child(pkg, preload=None):
    """Runs CHILD with cumem_torch from `pkg` and the shared cache; its
    JSON line."""
    env = dict(os.environ, CUMEM_TORCH_CACHE=str(CACHE),
               PYTHONPATH=os.pathsep.join([str(pkg.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    for k in ("CUMEM_TORCH_LIB", "CUMEM_TORCH_NATIVE", "CUMEM_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env.pop(k, None)
    if preload:
        env["ONE_MANAGER_PRELOAD"] = str(preload)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=240)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        sys.exit(f"FAILED: the process with cumem_torch from {pkg} failed (exit {r.returncode}):\n{r.stdout[-6000:]}")
    res = json.loads(lines[-1])
    assert res["package"] == os.path.realpath(pkg), f"cumem_torch came from {res['package']}, not {pkg}"
    return res


def builds():
    """The native libraries in the cache: {folder name: mtime}."""
    return {p.parent.name: p.stat().st_mtime_ns for p in CACHE.glob("*/libcumem_torch_native.so")}


def refused(res, *paths):
    """Whether install() refused with the error naming `paths`."""
    if "error" not in res:
        return False
    e = res["error"]
    assert "copies of cumem's library" in e and all(str(p) in e for p in paths), f"not the clear error: {e}"
    assert not res["installed"], "install() refused, yet installed"
    return True


def one_manager(res, pkg, what):
    lib = os.path.realpath(pkg / "libcumem_c.so")
    assert "error" not in res, f"{what}: install() raised: {res['error']}"
    assert res["backend"] == "native", f"{what}: no native backend ({res.get('native_error')})"
    assert res["native"] and res["native"].startswith(os.path.realpath(CACHE)), f"{what}: {res['native']} not cached"
    assert res["copies"] == [lib], f"{what}: libcumem_c.so mapped: {res['copies']} (want only {lib})"
    # stats()'s pool counts the untagged tensor; the tagged one is the tag's.
    assert res["in_use"] >= 16 * MIB, f"{what}: cumem_torch.stats() does not see PyTorch's tensor: {res}"
    assert res["tags"].get("weights", 0) >= 4 * MIB, f"{what}: the tagged tensor is not in tag_usage(): {res}"
    assert res["torch_allocated"] >= 20 * MIB, f"{what}: torch.cuda.memory_allocated() {res['torch_allocated']}"
    print(f"{what}: one libcumem_c.so ({lib}), in_use {res['in_use']} B, tag 'weights' {res['tags']['weights']} B")


a, b = install("A"), install("B")
print("wheel:", WHEEL, "| torch", torch.__version__, "| cache", CACHE)

# 1. A compiles the native backend into the fresh cache.
res = child(a)
one_manager(res, a, "A (compiled on first use)")
first = builds()
assert len(first) == 1, f"one build in the cache after A: {first}"
built = CACHE / next(iter(first)) / "libcumem_torch_native.so"
if shutil.which("readelf"):
    dyn = subprocess.run(["readelf", "-d", str(built)], stdout=subprocess.PIPE, text=True).stdout
    print("cached build:", built, "|", " ".join(l.split(None, 2)[-1] for l in dyn.splitlines()
                                               if "NEEDED" in l and "cumem" in l or "RUNPATH" in l or "RPATH" in l))

# 2. B, the same build of cumem: the same cached library (linked in A).
res = child(b)
assert builds() == first, f"B compiled again or touched the cache: {first} -> {builds()}"
if refused(res, a / "libcumem_c.so", b / "libcumem_c.so"):
    print("B (A's cached build): install() refused with the clear error:", res["error"][:300])
else:
    one_manager(res, b, "B (A's cached build)")

# 3. Control: A's copy in the global scope before cumem_torch loads B's:
# the native library's calls reach A's copy, and install() must see it.
res = child(b, preload=a / "libcumem_c.so")
assert refused(res, a / "libcumem_c.so", b / "libcumem_c.so"), f"control: two managers not refused: {res}"
print("control, A's copy loaded first: install() refused:", res["error"][:200])

# 4. C, a libcumem_c.so of other content (the old key, the first MiB,
# missed a change past it): a build of its own.
c = install("C")
with open(c / "libcumem_c.so", "ab") as f:
    f.write(b"\0" * 4096)
res = child(c)
after = builds()
assert len(after) == 2 and set(first) < set(after), f"C did not compile a build of its own: {first} -> {after}"
one_manager(res, c, "C (other content, compiled anew)")

shutil.rmtree(tmp)
print("smoke_one_manager: ok")
