"""The native backend: a C++ `CUDAAllocator` over cumem (csrc/), built
against the installed PyTorch.

Where it comes from, first found wins:
1. `libcumem_torch_native.so` installed with the package, when it was
   built against the PyTorch version now imported (`native_torch.txt`
   beside it says which) and `CUMEM_TORCH_LIB` is not set;
2. a copy compiled on first use into `CUMEM_TORCH_CACHE` (default
   `~/.cache/cumem_torch`), one per PyTorch version, from the sources
   installed with the package (`csrc/`), with the C++ compiler (`CXX`,
   else `c++`, else `g++`; the first whose library shares the process's
   libstdc++ instead of carrying a static copy) and the headers and
   libraries PyTorch ships. The cache folder's name hashes the PyTorch
   version, the flags, the sources and the whole of the libcumem_c.so
   Python loads, so another build of cumem never reuses a library
   compiled against a different one.

One cumem manager per process: the native library names libcumem_c.so by
its soname, so the dynamic linker gives it the copy Python loaded already
(whatever folder the cached build was linked in), and `library()` checks
that both reach one copy (`cumem_instance_id`) and that no second copy is
mapped (`/proc/self/maps`); otherwise it raises `TwoManagers`, which
`install()` passes on instead of falling back.
"""

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import threading

from . import _lib

HERE = pathlib.Path(__file__).resolve().parent
LIB_NAME = "libcumem_torch_native.so"
SOURCES = ("backend.cpp", "frees.cpp", "stats.cpp", "pools.cpp", "stream_cache.cpp", "install.cpp")

_lock = threading.Lock()
_lib_native = None


class NativeUnavailable(RuntimeError):
    """The native backend can't be built or loaded here (the message says why)."""


class TwoManagers(RuntimeError):
    """Two copies of cumem's library in the process, so two managers (Python's
    calls would reach one, PyTorch's allocations the other); names the files."""


def _torch_version():
    import torch
    return torch.__version__.split("+")[0]


def _cuda_dirs(wheel_sub, home_subs, pattern):
    """The folders holding `pattern`, in search order: PyTorch's CUDA
    wheels' (nvidia/cu13, nvidia/cuda_runtime; `wheel_sub` in them), then
    CUDA_HOME's (`home_subs` in it)."""
    home = pathlib.Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")
    wheels = [pathlib.Path(p) / "nvidia" / w / wheel_sub for p in sys.path for w in ("cu13", "cuda_runtime")]
    return [str(d) for d in wheels + [home / s for s in home_subs] if list(d.glob(pattern))]


def cuda_include_dirs():
    """Where the CUDA headers are, all of them (the wheels' cuda_runtime.h
    may need the toolkit's crt/ headers)."""
    return _cuda_dirs("include", ("include",), "cuda_runtime.h")


def cudart_dirs():
    """Where libcudart.so.* is."""
    return _cuda_dirs("lib", ("lib64", "lib"), "libcudart.so*")


def compile_library(out, torch_include, torch_lib, cuda_includes, cudart_dir, cumem_include, cumem_lib_dir,
                    sources_dir=None, cxx=None, rpath=None):
    """Compiles and links the native backend into `out` (a path). Raises
    NativeUnavailable with the compiler's output when it fails. Shared by
    the build backend (at `pip install`) and by first use. `cuda_includes`
    are the CUDA header folders (`cuda_include_dirs()`: PyTorch's nvidia
    wheel may hold cuda_runtime.h without the crt/ headers it includes,
    which the toolkit has). `rpath` is where the library finds
    libcumem_c.so at run time (default: beside itself): it must be the very
    file Python loads, or there would be two cumem managers."""
    compilers = _compilers(cxx)
    if not compilers:
        raise NativeUnavailable("no C++ compiler (set CXX)")
    src = pathlib.Path(sources_dir or HERE / "csrc")
    cudart = sorted(pathlib.Path(cudart_dir).glob("libcudart.so.*"))
    if not cudart:
        raise NativeUnavailable(f"no libcudart.so.* in {cudart_dir}")
    cmd = ["CXX", "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
           f"-D_GLIBCXX_USE_CXX11_ABI={_cxx11_abi()}",
           f"-I{torch_include}", f"-I{torch_include}/torch/csrc/api/include"]
    cmd += [f"-I{d}" for d in cuda_includes]
    cmd += [f"-I{cumem_include}"]
    cmd += [str(src / s) for s in SOURCES]
    cmd += [f"-L{torch_lib}", "-lc10", "-lc10_cuda", "-ltorch_cuda", f"-L{cudart_dir}", f"-l:{cudart[0].name}",
            f"-L{cumem_lib_dir}", "-lcumem_c", "-Wl,--no-undefined", f"-Wl,-rpath,{rpath or '$ORIGIN'}",
            "-o", str(out)]
    failures = []
    for compiler in compilers:
        cmd[0] = compiler
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            failures.append(f"compiling the native backend failed ({' '.join(cmd)}):\n{r.stdout[-4000:]}")
        elif not _shares_libstdcxx(out):
            # A toolchain whose libstdc++ is only static (a private GCC)
            # puts a second C++ runtime in the library: its streams then
            # meet PyTorch's locale and the first number formatted into an
            # error message faults. Another compiler, or none.
            failures.append(f"{compiler} linked libstdc++ into the library statically instead of sharing PyTorch's")
        else:
            return
    raise NativeUnavailable("\n".join(failures))


def _compilers(cxx=None):
    """The C++ compilers to try, in order: `cxx`, $CXX, then `c++` and
    `g++` on PATH (the system's, whose libstdc++ PyTorch loads)."""
    out = []
    for c in (cxx, os.environ.get("CXX"), shutil.which("c++"), shutil.which("g++")):
        if c and c not in out:
            out.append(c)
    return out


def _shares_libstdcxx(lib):
    """Whether `lib` loads the shared libstdc++ (names it as a needed
    library) rather than carrying its own copy."""
    try:
        return b"libstdc++.so.6" in pathlib.Path(lib).read_bytes()
    except OSError:
        return False


def _cxx11_abi():
    """The libstdc++ string ABI PyTorch was built with (1 unless PyTorch
    says otherwise). The library must use PyTorch's: with the other, a
    std::string or stream crossing into c10 (every error message PyTorch's
    checks format) is read with the wrong layout and the process faults."""
    try:
        import torch
        return int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    except (ImportError, AttributeError):
        return 1


# Part of the cache key: a change of the compiler flags compiles again.
BUILD_FLAGS = "O2 c++17 hidden cxx11-abi-from-torch shared-libstdc++"


def cache_key(torch_version, lib, sources_dir=None):
    """The name of the cache folder of a build against PyTorch
    `torch_version` and cumem's library `lib` (a path): a hash of the
    version, BUILD_FLAGS, the sources (with cumem.h where present) and the
    whole of `lib`, not of its path (two installs of one build share a
    build; the library then uses whichever copy is loaded, by soname)."""
    src = pathlib.Path(sources_dir or HERE / "csrc")
    key = hashlib.sha256()

    def part(data):
        key.update(len(data).to_bytes(8, "little"))
        key.update(data)

    part(torch_version.encode())
    part(BUILD_FLAGS.encode())
    for s in SOURCES + ("backend.h",):
        part((src / s).read_bytes())
    header = src / "cumem.h"  # in the wheel; a checkout's csrc/ has none
    part(header.read_bytes() if header.exists() else b"")
    whole = hashlib.sha256()
    with open(lib, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            whole.update(block)
    part(whole.digest())
    return key.hexdigest()[:16]


def _cache_dir():
    return pathlib.Path(os.environ.get("CUMEM_TORCH_CACHE", pathlib.Path.home() / ".cache" / "cumem_torch"))


def _build_here():
    """Compiles the library for the imported PyTorch into the cache (once)."""
    import torch
    from torch.utils import cpp_extension
    lib = pathlib.Path(_lib.library_path())
    d = _cache_dir() / cache_key(torch.__version__, lib)
    out = d / LIB_NAME
    if out.exists():
        return out
    if not (HERE / "csrc" / "backend.cpp").exists():
        raise NativeUnavailable("the package was installed without its C++ sources")
    inc = cuda_include_dirs()
    libs = cudart_dirs()
    if not inc or not libs:
        raise NativeUnavailable("CUDA headers or libcudart not found (PyTorch's nvidia wheels or CUDA_HOME)")
    d.mkdir(parents=True, exist_ok=True)
    if lib.name != "libcumem_c.so":
        raise NativeUnavailable(f"cumem's library must be named libcumem_c.so to link against (is {lib})")
    tmp = d / f"{LIB_NAME}.{os.getpid()}"
    # Linked against, and found at run time in, the directory of the very
    # libcumem_c.so Python loads (one cumem manager).
    compile_library(tmp, cpp_extension.include_paths()[0], os.path.join(os.path.dirname(torch.__file__), "lib"),
                    inc, libs[0], str(HERE / "csrc"), str(lib.parent), rpath=str(lib.parent))
    os.replace(tmp, out)
    return out


def library():
    """The loaded native library (built or compiled as the module says)."""
    global _lib_native
    with _lock:
        if _lib_native is not None:
            return _lib_native
        packaged = HERE / LIB_NAME
        stamp = HERE / "native_torch.txt"
        # The packaged library finds the package's libcumem_c.so; with
        # CUMEM_TORCH_LIB naming another, compile one that finds that.
        if (packaged.exists() and stamp.exists() and stamp.read_text().strip() == _torch_version()
                and not os.environ.get("CUMEM_TORCH_LIB")):
            path = packaged
        else:
            path = _build_here()
        # cumem's library first, from the package: the native library
        # names it by its soname, which the loaded copy answers to, so
        # both see one cumem manager.
        _lib.lib()
        l = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _lib.declare(l, "cumem_torch_native_install", [ctypes.c_char_p, ctypes.c_size_t])
        _lib.declare(l, "cumem_torch_native_active", [])
        try:
            _lib.declare(l, "cumem_torch_native_instance_id", [], ctypes.c_uint64)
        except AttributeError:
            raise NativeUnavailable(f"{path} predates cumem_torch_native_instance_id (a stale build)") from None
        check_one_manager(l.cumem_torch_native_instance_id(), path)
        _lib_native = l
        return l


def _file_mappings():
    """(start, end, device, inode, path) of each file mapped in this
    process (/proc/self/maps; empty where it can't be read)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        fields = line.rstrip("\n").split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        out.append((start, end, fields[3], fields[4], fields[5].removesuffix(" (deleted)")))
    return out


def mapped_file(address):
    """The file mapped at `address` in this process, or None."""
    for start, end, _, _, path in _file_mappings():
        if start <= address < end:
            return path
    return None


def loaded_copies():
    """The copies of cumem's library mapped in this process: one path per
    distinct file (device and inode) named libcumem_c*.so*."""
    seen = {}
    for _, _, dev, inode, path in _file_mappings():
        name = os.path.basename(path)
        if name.startswith("libcumem_c") and ".so" in name:
            seen.setdefault((dev, inode), path)
    return list(seen.values())


def check_one_manager(native_id, native_path):
    """Raises TwoManagers unless the native library `native_path`, whose
    calls reach the copy of cumem's library `native_id` (its
    cumem_instance_id), and Python's calls reach the same copy, and no
    other copy is mapped in the process."""
    ours = _lib.lib().cumem_instance_id()
    python_lib = mapped_file(ours) or _lib.library_path()
    advice = (f" Remove the native backend's cache ({_cache_dir()}, CUMEM_TORCH_CACHE) to compile it anew, and load "
              "no other libcumem_c.so into this process (CUMEM_TORCH_LIB names the one cumem_torch uses).")
    if native_id != ours:
        raise TwoManagers(
            "cumem_torch: two copies of cumem's library in this process, so two cumem managers: Python's calls "
            f"(install()'s configuration, tags, sleep and wake, statistics) reach {python_lib}, while the native "
            f"backend {native_path} allocates PyTorch's memory from {mapped_file(native_id) or 'another copy'}."
            + advice)
    copies = loaded_copies()
    if len(copies) > 1:
        raise TwoManagers(
            f"cumem_torch: {len(copies)} copies of cumem's library are mapped in this process ({', '.join(copies)}), "
            f"each a cumem manager of its own; Python and the native backend use {python_lib}." + advice)


def install():
    """Makes the native backend PyTorch's allocator; raises RuntimeError with PyTorch's reason when it refuses."""
    l = library()
    buf = ctypes.create_string_buffer(2048)
    if l.cumem_torch_native_install(buf, len(buf)) != 0:
        raise RuntimeError(buf.value.decode(errors="replace"))


def active():
    return _lib_native is not None and _lib_native.cumem_torch_native_active() == 1
