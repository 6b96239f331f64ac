#!/usr/bin/env bash
# DistributedDataParallel with PyTorch's allocator and with cumem
# (cumem_torch), alternated: python/bench/ddp.py under torchrun.
#
#   scripts/ddp.sh build   # here: the cumem_torch wheel into .whl/ (git-ignored)
#   scripts/ddp.sh run     # on the GPU machine (carry .whl/): installs the wheel into a
#                          # folder on PYTHONPATH, runs torchrun on every GPU with
#                          # --allocator torch, cumem, torch, cumem and compares;
#                          # JSONs, logs and comparison.txt go to $OUT (or ddp-logs/)
#
# Optional environment: PYTHON (one with torch and transformers; default
# python3, else /opt/torch/.venv/bin/python3), DDP_GPUS (default: all),
# DDP_PAIRS (default 2), DDP_ALLOCATORS (one pair's order; default "torch
# cumem"), DDP_ARGS (more ddp.py options), DDP_TIMEOUT (seconds per
# torchrun; default 240), NCCL_DEBUG (default WARN).
set -uo pipefail
cd "$(dirname "$0")/.."

build() {
    set -e
    rm -rf .whl
    python3 -m pip wheel --no-deps -w .whl ./python
    ls -l .whl
}

python_with_torch() {
    local py
    for py in ${PYTHON:-} python3 /opt/torch/.venv/bin/python3; do
        if command -v "$py" >/dev/null && "$py" -c "import torch, transformers" 2>/dev/null; then
            echo "$py"
            return 0
        fi
    done
    return 1
}

run() {
    local dest=${OUT:-ddp-logs}
    mkdir -p "$dest"
    local py whl site gpus
    if ! py=$(python_with_torch); then
        echo "FAILED: no Python with torch and transformers (set PYTHON)"
        return 1
    fi
    whl=$(ls .whl/cumem_torch-*.whl 2>/dev/null | head -1)
    if [ -z "$whl" ]; then
        echo "FAILED: no .whl/cumem_torch-*.whl (scripts/ddp.sh build makes it here; carry .whl)"
        return 1
    fi
    site=$(mktemp -d /tmp/cumem-ddp-site.XXXXXX)
    if ! "$py" -m pip install --no-deps --no-index --target "$site" "$whl" >"$dest/pip.log" 2>&1; then
        cat "$dest/pip.log"
        echo "FAILED: installing $whl"
        return 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_DEBUG=${NCCL_DEBUG:-WARN} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
    unset PYTORCH_CUDA_ALLOC_CONF
    "$py" -c "import cumem_torch, torch; print('python', __import__('sys').executable, '| torch', torch.__version__,
'| CUDA', torch.version.cuda, '| NCCL', '.'.join(map(str, torch.cuda.nccl.version())), '| GPUs', torch.cuda.device_count(),
'| cumem_torch from', cumem_torch.library_path())" 2>&1 | tee "$dest/versions.txt"
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee -a "$dest/versions.txt"
    echo "/dev/shm: $(df -h /dev/shm 2>/dev/null | tail -1)" | tee -a "$dest/versions.txt"
    gpus=${DDP_GPUS:-$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)}
    if ! [ "${gpus:-0}" -ge 1 ] 2>/dev/null; then
        echo "FAILED: no GPU for DDP (torch.cuda.device_count() = ${gpus:-?})"
        return 1
    fi
    if [ "$gpus" = 1 ]; then
        echo "one GPU: --nproc_per_node=1 (DDP's all-reduce over one rank is a local copy: this compares the allocators, not communication)"
    fi

    local runs=() failed=0 i a tag rc k=0
    for i in $(seq 1 "${DDP_PAIRS:-2}"); do
        for a in ${DDP_ALLOCATORS:-torch cumem}; do
            k=$((k + 1))
            tag="$k-$a"
            echo "== torchrun --standalone --nproc_per_node=$gpus python/bench/ddp.py --allocator $a ${DDP_ARGS:-}"
            # shellcheck disable=SC2086  # DDP_ARGS is a list of options
            timeout "${DDP_TIMEOUT:-240}" "$py" -m torch.distributed.run --standalone --nproc_per_node="$gpus" \
                python/bench/ddp.py --allocator "$a" --out "$dest/ddp-$tag.json" ${DDP_ARGS:-} >"$dest/ddp-$tag.log" 2>&1
            rc=$?
            if [ $rc = 0 ] && [ -s "$dest/ddp-$tag.json" ]; then
                runs+=("$dest/ddp-$tag.json")
                grep -E "^ddp |NCCL WARN|cumem:" "$dest/ddp-$tag.log" | tail -5
            else
                echo "FAILED: $tag (rc $rc$([ $rc = 124 ] && echo ', timed out'))"
                tail -40 "$dest/ddp-$tag.log"
                failed=1
            fi
        done
    done
    if [ ${#runs[@]} -gt 0 ]; then
        if ! "$py" python/bench/ddp.py --compare "${runs[@]}" 2>&1 | tee "$dest/comparison.txt"; then
            echo "the losses differ (above)"
            failed=1
        fi
    fi
    [ $failed = 0 ] && echo "DDP: PASSED" || echo "DDP: FAILED"
    return $failed
}

case "${1:-}" in
build) build ;;
run) run ;;
*) echo "usage: $0 build | run" >&2; exit 2 ;;
esac
