"""A PEP 517 build backend for cumem_torch that needs nothing but cargo and
the Python standard library: it builds cumem's C ABI crate (cumem-c) with
cargo and packs the shared library with the Python package into a wheel.

The wheel holds no Python extension module (the library is loaded with
ctypes, and by PyTorch's CUDAPluggableAllocator), so it is tagged
`py3-none-<platform>`: one wheel for every Python 3 version.

Environment: CARGO (the cargo to run), CARGO_TARGET_DIR (honoured by
cargo), CUMEM_PROFILE (`release`, the default, or `dev`).
"""

import base64
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sysconfig
import tempfile
import zipfile

PYTHON_DIR = pathlib.Path(__file__).resolve().parent.parent
REPO = PYTHON_DIR.parent
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
            f"cumem_torch builds from a checkout of the cumem workspace: {REPO / 'cumem-c'} is missing "
            "(install from the checkout's python/ folder, in place)")
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


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _metadata():
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\nSummary: {SUMMARY}\n"
            "License: MIT OR Apache-2.0\nRequires-Python: >=3.8\n")


def get_requires_for_build_wheel(config_settings=None):
    return []


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
