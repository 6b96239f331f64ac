# Installs cumem's native backend before anything touches CUDA, in every
# Python process started with this directory on PYTHONPATH and
# CUMEM_TEST_INSTALL=1 (PyTorch's tests, their subprocesses too).
import os

if os.environ.get("CUMEM_TEST_INSTALL") == "1":
    import cumem_torch

    kind = cumem_torch.install()
    if kind != "native":
        raise SystemExit(f"cumem_torch.install() took the {kind} path")
