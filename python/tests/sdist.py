#!/usr/bin/env python3
"""The build backend's sdist (PEP 517 `build_sdist`): it holds the Python
project at its root and every part of cumem's Rust workspace that cargo
needs under rust/, and cargo reads that workspace as it is. With
CUMEM_SDIST_BUILD=1 it also builds a wheel from the unpacked sdist with pip
(a full cargo build; CUMEM_PROFILE=dev makes it shorter) and checks that the
wheel holds the C ABI's library. Runs from any directory, without PyTorch
or a GPU."""

import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile

PYTHON_DIR = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PYTHON_DIR / "build_backend"))
import cumem_build  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    assert cumem_build.get_requires_for_build_sdist() == []
    name = cumem_build.build_sdist(str(tmp))
    assert name == "cumem_torch-0.1.0.tar.gz", name
    with tarfile.open(tmp / name) as tar:
        names = tar.getnames()
        tar.extractall(tmp / "x", filter="data") if sys.version_info >= (3, 12) else tar.extractall(tmp / "x")
    root = "cumem_torch-0.1.0/"
    assert all(n.startswith(root) for n in names), names[:5]
    inside = {n[len(root):] for n in names}
    for needed in ["PKG-INFO", "pyproject.toml", "build_backend/cumem_build.py", "cumem_torch/__init__.py",
                   "cumem_torch/csrc/backend.cpp", "rust/Cargo.toml", "rust/Cargo.lock", "rust/README.md",
                   "rust/src/lib.rs", "rust/cumem-c/Cargo.toml", "rust/cumem-c/src/lib.rs",
                   "rust/cumem-c/include/cumem.h", "rust/cumem-replay/Cargo.toml", "rust/loom-tests/Cargo.toml", "rust/benches/Cargo.toml",
                   "rust/docs/guide.md", "rust/benches/pair.rs"]:
        assert needed in inside, f"the sdist lacks {needed}"
    for n in inside:
        parts = pathlib.PurePosixPath(n).parts
        assert "target" not in parts and "__pycache__" not in parts and not n.endswith((".so", ".whl")), n
    # Same sources, same archive.
    again = tmp / "again"
    again.mkdir()
    cumem_build.build_sdist(str(again))
    assert (again / name).read_bytes() == (tmp / name).read_bytes(), "the sdist is not reproducible"
    # The unpacked sdist is a cargo workspace with the C ABI crate in it,
    # and its backend builds from rust/, not from a checkout around it.
    src = tmp / "x" / "cumem_torch-0.1.0"
    meta = subprocess.run([os.environ.get("CARGO", "cargo"), "metadata", "--no-deps", "--format-version", "1",
                           "--manifest-path", str(src / "rust" / "Cargo.toml")],
                          stdout=subprocess.PIPE, check=True, text=True).stdout
    packages = {p["name"] for p in json.loads(meta)["packages"]}
    assert {"cumem", "cumem-c"} <= packages, packages
    probe = subprocess.run([sys.executable, "-c", "import cumem_build; print(cumem_build.REPO)"],
                           cwd=src / "build_backend", stdout=subprocess.PIPE, check=True, text=True).stdout.strip()
    assert pathlib.Path(probe) == src / "rust", probe
    if os.environ.get("CUMEM_SDIST_BUILD") == "1":
        # The archive's files are dated 2020 (a reproducible sdist); with a
        # CARGO_TARGET_DIR shared with a checkout, cargo would take them for
        # older than its last build of the same crates: date them now.
        for f in src.rglob("*"):
            os.utime(f)
        wheels = tmp / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                        str(src)], check=True)
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            assert "cumem_torch/libcumem_c.so" in z.namelist(), z.namelist()
        print("sdist test: built", wheel.name, "from the sdist")
    print(f"sdist test: ok ({len(names)} files)")
