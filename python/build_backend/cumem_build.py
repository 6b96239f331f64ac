"""A PEP 517 build backend for cumem_torch that needs nothing but cargo and
the Python standard library: it builds cumem's C ABI crate (cumem-c) with
cargo and packs the shared library with the Python package into a wheel.

Where PyTorch is found, it also compiles the native backend
(`cumem_torch/csrc/`) against it into `libcumem_torch_native.so`, with
`native_torch.txt` naming the PyTorch version (`native_build.txt` says
what was done or why not). Neither library is a Python extension module
(both are loaded with ctypes), so one `py3-none-<platform>` wheel serves
every Python 3. The C++ sources and cumem.h go in too, for `install()` to
compile the backend on first use against another PyTorch.

Environment: CARGO (the cargo to run), CARGO_TARGET_DIR (honoured by
cargo), CUMEM_PROFILE (`release`, the default, or `dev`); CXX (the C++
compiler). PyTorch is found by importing it with the interpreter running
the build (`-I`: outside pip's build isolation), or named by
CUMEM_TORCH_ROOT (a `torch` package directory with `include/` and `lib/`),
CUMEM_TORCH_VERSION (its version) and CUMEM_CUDA_ROOT (a directory with
`include/cuda_runtime.h` and `lib/libcudart.so.*`), for building against
extracted headers. CUMEM_TORCH_NATIVE=0 skips the native backend.
"""

import base64
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

PYTHON_DIR = pathlib.Path(__file__).resolve().parent.parent
# An sdist carries the Rust workspace in rust/ beside pyproject.toml; a
# checkout has python/ inside the workspace.
SDIST_RUST = "rust"
REPO = PYTHON_DIR / SDIST_RUST if (PYTHON_DIR / SDIST_RUST / "Cargo.toml").exists() else PYTHON_DIR.parent
# What of the workspace an sdist carries: every member's manifest and
# sources (cargo reads every member of the workspace), the lock file, and
# the files the sources include (README.md, docs/).
RUST_FILES = ["Cargo.toml", "Cargo.lock", "README.md", "rustfmt.toml"]
RUST_DIRS = ["src", "benches", "examples", "tests", "docs", "cumem-c", "cumem-replay", "loom-tests"]
# Build outputs and caches never go in.
SKIP = {"target", "__pycache__", "gpu-bin", "dist", "build"}
PACKAGE = "cumem_torch"
DIST = "cumem_torch"
NAME = "cumem-torch"
VERSION = "0.1.0"
SUMMARY = "cumem's CUDA memory pools as PyTorch's allocator (CUDAPluggableAllocator), with statistics"


def _tag():
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"py3-none-{platform}"


def _build_library():
    """Runs cargo; returns the path of libcumem_c.so."""
    if not (REPO / "cumem-c" / "Cargo.toml").exists():
        raise RuntimeError(
            f"cumem_torch builds from a checkout of the cumem workspace or from its sdist: {REPO / 'cumem-c'} "
            "is missing (install from the checkout's python/ folder, in place, or from the sdist)")
    cmd = [os.environ.get("CARGO", "cargo"), "build", "-p", "cumem-c", "--lib",
           "--message-format=json-render-diagnostics"]
    if os.environ.get("CUMEM_PROFILE", "release") == "release":
        cmd.append("--release")
    out = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, check=True, text=True).stdout
    found = None
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == "cumem_c":
            found = next((f for f in msg["filenames"] if f.endswith(".so")), found)
    if found is None:
        raise RuntimeError("cargo built no libcumem_c.so")
    return pathlib.Path(found)


# PyTorch and CUDA as the interpreter with PyTorch sees them (`-I`: outside
# pip's build isolation), found as first use finds them (`_native`).
_FIND_TORCH = r"""
import json, os, sys
import torch
sys.path.insert(0, sys.argv[1])
from cumem_torch import _native
print(json.dumps({"root": os.path.dirname(torch.__file__), "version": torch.__version__.split("+")[0],
                  "cuda_built": torch.version.cuda, "include": _native.cuda_include_dirs(),
                  "cudart": _native.cudart_dirs()}))
"""


def _find_torch():
    """(torch root, version, CUDA header dirs, libcudart dirs), or why not."""
    if os.environ.get("CUMEM_TORCH_NATIVE") == "0":
        return "CUMEM_TORCH_NATIVE=0"
    root = os.environ.get("CUMEM_TORCH_ROOT")
    if root:
        # The version `install()` compares with: PyTorch's, without its
        # local part ("2.11.0+cu130" is stamped "2.11.0").
        version = os.environ.get("CUMEM_TORCH_VERSION", "").split("+")[0]
        cuda = os.environ.get("CUMEM_CUDA_ROOT")
        if not cuda:
            return root, version, [], []
        cudart = [d for d in (f"{cuda}/lib", f"{cuda}/lib64") if list(pathlib.Path(d).glob("libcudart.so*"))]
        return root, version, [f"{cuda}/include"], cudart
    r = subprocess.run([sys.executable, "-I", "-c", _FIND_TORCH, str(PYTHON_DIR)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"PyTorch is not importable by {sys.executable} ({last})"
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if not info.get("cuda_built"):
        return f"PyTorch {info['version']} is built without CUDA"
    return info["root"], info["version"], info["include"], info["cudart"]


def _build_native(tmp, libcumem):
    """Compiles the native backend; returns (files for the wheel, note)."""
    found = _find_torch()
    if isinstance(found, str):
        return [], f"native backend skipped: {found}"
    root, version, include, cudart = found
    if not include or not cudart:
        return [], f"native backend skipped: no CUDA headers or libcudart found for PyTorch {version} (set CUDA_HOME)"
    sys.path.insert(0, str(PYTHON_DIR))
    try:
        from cumem_torch import _native  # the compile step is shared with first use
    finally:
        sys.path.pop(0)
    out = pathlib.Path(tmp) / _native.LIB_NAME
    try:
        _native.compile_library(out, f"{root}/include", f"{root}/lib", include, cudart[0],
                                str(REPO / "cumem-c" / "include"), str(pathlib.Path(libcumem).parent),
                                sources_dir=PYTHON_DIR / PACKAGE / "csrc")
    except _native.NativeUnavailable as e:
        # Not fatal: install() compiles on first use or falls back.
        print(f"cumem_build: {e}", file=sys.stderr)
        return [], f"native backend not built: {str(e).splitlines()[0]}"
    if shutil.which("strip"):
        subprocess.run(["strip", "--strip-debug", str(out)], check=True)
    files = [(f"{PACKAGE}/{_native.LIB_NAME}", out.read_bytes()),
             (f"{PACKAGE}/native_torch.txt", (version + "\n").encode())]
    return files, f"native backend built against PyTorch {version}"


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _metadata():
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\nSummary: {SUMMARY}\n"
            "License: MIT OR Apache-2.0\nRequires-Python: >=3.8\n")


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def _tree(root, rel):
    """The files under `root / rel` (or the file itself), as paths relative
    to `root`, sorted, without build outputs, caches or hidden files."""
    path = root / rel
    if path.is_file():
        return [pathlib.PurePosixPath(rel)]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP and not d.startswith(".") and not d.endswith(".egg-info"))
        for f in sorted(filenames):
            if not f.startswith(".") and not f.endswith((".pyc", ".so", ".whl")):
                out.append(pathlib.PurePosixPath(pathlib.Path(dirpath, f).relative_to(root).as_posix()))
    return out


def sdist_files():
    """(name in the sdist, path here) of every file an sdist holds: the
    Python project (pyproject.toml, the backend, the package and its
    tests) at its root and the Rust workspace under rust/."""
    files = []
    for rel in ["pyproject.toml", "build_backend", PACKAGE, "tests"]:
        if (PYTHON_DIR / rel).exists():
            files += [(str(p), PYTHON_DIR / p) for p in _tree(PYTHON_DIR, rel)]
    for rel in RUST_FILES + RUST_DIRS:
        if not (REPO / rel).exists():
            raise RuntimeError(f"the sdist needs {REPO / rel}, which is missing")
        files += [(f"{SDIST_RUST}/{p}", REPO / p) for p in _tree(REPO, rel)]
    return files


def build_sdist(sdist_directory, config_settings=None):
    """A source distribution that builds with cargo alone: the Python
    project at its root and cumem's Rust workspace in rust/ (the backend
    finds it there). Returns its file name."""
    import gzip
    import io
    import tarfile
    base = f"{DIST}-{VERSION}"
    name = f"{base}.tar.gz"
    mtime = 1577836800  # 2020-01-01: the same sources give the same archive

    def add(tar, arcname, data, mode=0o644):
        info = tarfile.TarInfo(f"{base}/{arcname}")
        info.size, info.mtime, info.mode = len(data), mtime, mode
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(data))

    # gzip without a time stamp or a file name in its header.
    with open(pathlib.Path(sdist_directory) / name, "wb") as f, \
            gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "PKG-INFO", _metadata().encode())
        for arcname, path in sdist_files():
            add(tar, arcname, path.read_bytes(), 0o755 if os.access(path, os.X_OK) else 0o644)
    return name


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = pathlib.Path(metadata_directory) / f"{DIST}-{VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(_metadata())
    return info.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    so = _build_library()
    with tempfile.TemporaryDirectory() as tmp:
        lib = pathlib.Path(tmp) / "libcumem_c.so"
        shutil.copyfile(so, lib)
        # The release profile keeps line tables (for profiling Rust);
        # the wheel does not need them.
        if shutil.which("strip"):
            subprocess.run(["strip", "--strip-debug", str(lib)], check=True)
        files = [(f"{PACKAGE}/libcumem_c.so", lib.read_bytes())]
        for py in sorted((PYTHON_DIR / PACKAGE).glob("*.py")):
            files.append((f"{PACKAGE}/{py.name}", py.read_bytes()))
        for src in sorted((PYTHON_DIR / PACKAGE / "csrc").glob("*.[ch]*")):
            files.append((f"{PACKAGE}/csrc/{src.name}", src.read_bytes()))
        files.append((f"{PACKAGE}/csrc/cumem.h", (REPO / "cumem-c" / "include" / "cumem.h").read_bytes()))
        native, note = _build_native(tmp, so)
        print(f"cumem_build: {note}", file=sys.stderr)
        files += native
        files.append((f"{PACKAGE}/native_build.txt", (note + "\n").encode()))
        info = f"{DIST}-{VERSION}.dist-info"
        wheel_meta = (f"Wheel-Version: 1.0\nGenerator: cumem_build {VERSION}\nRoot-Is-Purelib: false\n"
                      f"Tag: {_tag()}\n")
        files.append((f"{info}/METADATA", _metadata().encode()))
        files.append((f"{info}/WHEEL", wheel_meta.encode()))
        record = [_record_line(n, d) for n, d in files] + [f"{info}/RECORD,,"]
        files.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode()))
        name = f"{DIST}-{VERSION}-{_tag()}.whl"
        with zipfile.ZipFile(pathlib.Path(wheel_directory) / name, "w", zipfile.ZIP_DEFLATED) as z:
            for arcname, data in files:
                zi = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
                zi.external_attr = (0o755 if arcname.endswith(".so") else 0o644) << 16
                zi.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(zi, data)
    return name
