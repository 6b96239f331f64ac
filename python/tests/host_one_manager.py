#!/usr/bin/env python3
"""One cumem manager per process, without PyTorch or a GPU (CI runs it
after host_ctypes.py): the parts of cumem_torch's guarantee that need no
native backend.

- libcumem_c.so has the soname libcumem_c.so (readelf -d);
- the native backend's cache key covers the whole library, not its path
  (a change past the first MiB gives another key);
- cumem_instance_id differs between two copies loaded from two folders,
  and /proc/self/maps names each;
- a stand-in for the native backend (a small C library linked, like
  `_native._build_here` links it, against the copy in folder A with A as
  its runpath) loaded beside folder B's copy shares B's: one copy mapped,
  and `_native.check_one_manager` passes;
- controls: the same stand-in with A's copy loaded into the global scope
  first, a second copy mapped by full path, and a copy of the library
  without its soname (the bug: the stand-in loads A's copy beside B's)
  each make `check_one_manager` raise TwoManagers naming both files;
- `install()` itself, with a stand-in PyTorch module and the stand-in as
  the package's native library, packaged or found in the cache as first
  use compiled it for another install: "native" with one copy,
  RuntimeError (never the pluggable fallback) naming both files with two.

The library is CUMEM_TORCH_LIB's, else the installed package's. The
stand-in needs a C compiler (`CC`, else `cc`) and readelf: without them
those parts print why and pass, unless CUMEM_REQUIRE_CC=1."""

import os
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile

from cumem_torch import _lib, _native

REQUIRE = os.environ.get("CUMEM_REQUIRE_CC") == "1"
LIB = pathlib.Path(_lib.library_path())
tmp = pathlib.Path(tempfile.mkdtemp(prefix="cumem-onelib-"))


def skip(why):
    if REQUIRE:
        raise SystemExit(f"FAILED: {why} (CUMEM_REQUIRE_CC=1)")
    print(f"skipped: {why}")


def copy_to(folder, lib=LIB):
    d = tmp / folder
    d.mkdir()
    shutil.copyfile(lib, d / "libcumem_c.so")
    return d / "libcumem_c.so"


def without_soname(src, dst):
    """Writes a copy of the ELF64 library `src` whose dynamic section has
    no DT_SONAME (the entries after it move up one; the terminator is
    doubled), as libcumem_c.so was before it had one."""
    data = bytearray(pathlib.Path(src).read_bytes())
    assert data[:5] == b"\x7fELF\x02", "an ELF64 library"
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type != 2:  # PT_DYNAMIC
            continue
        entries = [struct.unpack_from("<qQ", data, p_offset + k) for k in range(0, p_filesz, 16)]
        kept = [e for e in entries if e[0] != 14]  # DT_SONAME
        assert len(kept) == len(entries) - 1, "one DT_SONAME to take out"
        kept.append((0, 0))
        for k, (tag, val) in enumerate(kept):
            struct.pack_into("<qQ", data, p_offset + 16 * k, tag, val)
        pathlib.Path(dst).write_bytes(bytes(data))
        return
    raise AssertionError("no PT_DYNAMIC")


def run(code, cumem_lib):
    """Runs `code` in a fresh Python with CUMEM_TORCH_LIB=`cumem_lib`;
    returns its output (fails the test when it fails)."""
    env = dict(os.environ, CUMEM_TORCH_LIB=str(cumem_lib), PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    if r.returncode != 0:
        raise SystemExit(f"FAILED: a child process failed:\n{code}\n---\n{r.stdout}")
    return r.stdout


a_lib, b_lib = copy_to("A"), copy_to("B")

# The soname: a library linked against libcumem_c.so names it by it, and
# the copy already loaded answers to it.
readelf = shutil.which("readelf")
if readelf:
    dyn = subprocess.run([readelf, "-d", str(LIB)], stdout=subprocess.PIPE, text=True, check=True).stdout
    assert "Library soname: [libcumem_c.so]" in dyn, f"{LIB} has no soname libcumem_c.so:\n{dyn}"
    print("soname libcumem_c.so: ok")
else:
    skip("no readelf to read libcumem_c.so's soname")

# The cache key: the library's content, all of it, not where it is.
key = _native.cache_key
assert key("2.9.0", a_lib) == key("2.9.0", b_lib), "two installs of one build share a build"
assert key("2.9.0", a_lib) != key("2.10.0", a_lib)
size = a_lib.stat().st_size
assert size > (1 << 20) + 100, f"a library over 1 MiB to change past the first ({size} B)"
changed = bytearray(a_lib.read_bytes())
changed[size - 100] ^= 0xFF  # past the first MiB: the old key (first MiB) missed it
(tmp / "changed.so").write_bytes(bytes(changed))
assert key("2.9.0", tmp / "changed.so") != key("2.9.0", a_lib), "a change past the first MiB changes the key"
print("cache key covers the whole library: ok")

# Two copies by full path: two instance ids, each in its own file.
print(run(f"""
import ctypes
from cumem_torch import _native
ids = []
for p in ({str(a_lib)!r}, {str(b_lib)!r}):
    l = ctypes.CDLL(p)
    l.cumem_instance_id.restype = ctypes.c_uint64
    ids.append(l.cumem_instance_id())
    assert ids[-1] != 0 and l.cumem_instance_id() == ids[-1]
    assert _native.mapped_file(ids[-1]) == p, (_native.mapped_file(ids[-1]), p)
assert ids[0] != ids[1], ids
assert sorted(_native.loaded_copies()) == sorted([{str(a_lib)!r}, {str(b_lib)!r}]), _native.loaded_copies()
print("two copies, two instance ids:", [hex(i) for i in ids])
""", b_lib).strip())

# The stand-in for the native backend, linked as _build_here links it:
# against A's copy, found at run time in A.
cc = os.environ.get("CC") or shutil.which("cc")
if not cc:
    skip("no C compiler (CC or cc) for the stand-in native library")
    raise SystemExit(0)


STAND_IN = r"""
#include <stddef.h>
#include <stdint.h>
uint64_t cumem_instance_id(void);
static int installed = 0;
__attribute__((visibility("default"))) uint64_t cumem_torch_native_instance_id(void) { return cumem_instance_id(); }
__attribute__((visibility("default"))) int cumem_torch_native_install(char* err, size_t len) {
  (void)err;
  (void)len;
  installed = 1;
  return 0;
}
__attribute__((visibility("default"))) int cumem_torch_native_active(void) { return installed; }
"""


def stand_in(cumem_dir, name):
    """The stand-in native library (the native backend's entry points
    that need no PyTorch), linked against `cumem_dir`'s libcumem_c.so and
    finding it there at run time, as _build_here links the backend."""
    (tmp / "shim.c").write_text(STAND_IN)
    out = tmp / name
    subprocess.run([cc, "-shared", "-fPIC", str(tmp / "shim.c"), f"-L{cumem_dir}", "-lcumem_c", "-Wl,--no-undefined",
                    f"-Wl,-rpath,{cumem_dir}", "-o", str(out)], check=True)
    return out


shim = stand_in(a_lib.parent, "native_a.so")
LOAD = """
import ctypes
from cumem_torch import _lib, _native
{before}
_lib.lib()
shim = ctypes.CDLL({shim!r}, mode=ctypes.RTLD_GLOBAL)
shim.cumem_torch_native_instance_id.restype = ctypes.c_uint64
{after}
try:
    _native.check_one_manager(shim.cumem_torch_native_instance_id(), {shim!r})
except _native.TwoManagers as e:
    print("TwoManagers:", e)
else:
    print("one manager:", _native.loaded_copies())
"""

# B's copy loaded first (as Python loads it): the stand-in takes it.
out = run(LOAD.format(before="", after="", shim=str(shim)), b_lib)
assert out.startswith("one manager:") and str(b_lib) in out and str(a_lib) not in out, out
print("a native library linked against A, beside B's copy, shares it:", out.strip())

# Control: A's copy in the global scope first: the stand-in's calls reach
# it, Python's reach B's.
before = f"ctypes.CDLL({str(a_lib)!r}, mode=ctypes.RTLD_GLOBAL)"
out = run(LOAD.format(before=before, after="", shim=str(shim)), b_lib)
assert out.startswith("TwoManagers:") and "two copies" in out and str(a_lib) in out and str(b_lib) in out, out
print("control, the stand-in reaches another copy: raised")

# Control: both reach B's copy, but a second copy is mapped.
after = f"ctypes.CDLL({str(a_lib)!r})"
out = run(LOAD.format(before="", after=after, shim=str(shim)), b_lib)
assert out.startswith("TwoManagers:") and "2 copies" in out and str(a_lib) in out and str(b_lib) in out, out
print("control, a second copy mapped: raised")

# Control, the bug itself: libraries without the soname. The stand-in
# linked against A's finds A's through its runpath, beside B's.
old_a, old_b = tmp / "oldA" / "libcumem_c.so", tmp / "oldB" / "libcumem_c.so"
for p in (old_a, old_b):
    p.parent.mkdir()
    without_soname(LIB, p)
old_shim = stand_in(old_a.parent, "native_old_a.so")
out = run(LOAD.format(before="", after="", shim=str(old_shim)), old_b)
assert out.startswith("TwoManagers:") and str(old_a) in out and str(old_b) in out, out
print("control, libraries without a soname load twice: raised")

# install() end to end, with a stand-in PyTorch (a module with a version)
# and B's package, whose native library is the stand-in linked against A's
# copy: (1) packaged with B (as a wheel built with PyTorch ships it), (2)
# in the cache under the key of B's library, as if compiled on first use
# by install A (the bug's setting: one build of cumem, one key). One
# manager: "native"; with A's copy first in the global scope:
# RuntimeError (TwoManagers) naming both, no fallback, nothing installed.
fake = tmp / "fake"
(fake / "torch" / "utils").mkdir(parents=True)
(fake / "torch" / "__init__.py").write_text(
    'import types\n__version__ = "0.0.0"\ncuda = types.SimpleNamespace(is_initialized=lambda: False)\n')
(fake / "torch" / "utils" / "__init__.py").write_text("")
(fake / "torch" / "utils" / "cpp_extension.py").write_text("")
cache = tmp / "cache"


def package(folder, packaged):
    pkg = tmp / folder / "cumem_torch"
    shutil.copytree(pathlib.Path(_native.__file__).parent, pkg,
                    ignore=shutil.ignore_patterns("*.so", "*.txt", "__pycache__"))
    shutil.copyfile(b_lib, pkg / "libcumem_c.so")
    if packaged:
        shutil.copyfile(shim, pkg / _native.LIB_NAME)
        (pkg / "native_torch.txt").write_text("0.0.0\n")
    else:
        entry = cache / _native.cache_key("0.0.0", pkg / "libcumem_c.so", sources_dir=pkg / "csrc")
        entry.mkdir(parents=True)
        shutil.copyfile(shim, entry / _native.LIB_NAME)
    return pkg


INSTALL = """
import ctypes, os, warnings
{before}
warnings.simplefilter("error")  # a fallback to the pluggable path warns
import cumem_torch
from cumem_torch import _native
assert os.path.dirname(cumem_torch.__file__) == {pkg!r}, cumem_torch.__file__
try:
    print("installed:", cumem_torch.install(), cumem_torch.stats()["pool"]["in_use"], _native._lib_native._name)
except RuntimeError as e:
    assert type(e).__name__ == "TwoManagers" and not cumem_torch.is_installed(), e
    print("refused:", e)
"""
preload_a = f"ctypes.CDLL({str(a_lib)!r}, mode=ctypes.RTLD_GLOBAL)"
for folder, packaged in (("packaged", True), ("cached", False)):
    pkg = package(folder, packaged)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg.parent), str(fake)]), CUMEM_TORCH_CACHE=str(cache))
    env.pop("CUMEM_TORCH_LIB", None)
    for before, want in (("", "installed: native 0"), (preload_a, "refused:")):
        r = subprocess.run([sys.executable, "-c", INSTALL.format(before=before, pkg=str(pkg))], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        what = f"install() ({folder}, {'A loaded first' if before else 'one copy'})"
        assert r.returncode == 0 and r.stdout.startswith(want), f"{what}:\n{r.stdout}"
        native = pkg / _native.LIB_NAME if packaged else next(cache.glob("*/" + _native.LIB_NAME))
        assert str(native) in r.stdout, f"{what} did not load {native}:\n{r.stdout}"
        if want == "refused:":
            assert str(a_lib) in r.stdout and str(pkg / "libcumem_c.so") in r.stdout, r.stdout
    print(f"install() with the stand-in {folder}: native with one copy, RuntimeError naming both with two: ok")

shutil.rmtree(tmp)
print("host_one_manager: ok")
