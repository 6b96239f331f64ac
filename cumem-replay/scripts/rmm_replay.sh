#!/bin/bash
# Builds rmm_replay.cpp against RMM's C++ sources and replays traces
# through RMM's pool_memory_resource (one JSON line per trace, as
# torch_replay.py prints for PyTorch).
#
#     RMM_DIR=path/to/rmm/cpp cumem-replay/scripts/rmm_replay.sh TRACE.csv.gz ...
#
# RMM_DIR is the `cpp` folder of an RMM checkout at v25.08.00 (the last
# release whose pool is all in its headers; rapidsai/rmm on GitHub). Its
# logging library is replaced by the stubs in rmm_shim/ (the replay logs
# nothing). Needs nvcc (CUDA 13's CCCL provides `cuda/memory_resource`
# and thrust). The binary goes to ${RMM_REPLAY_BIN:-target/rmm_replay}.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${RMM_DIR:?set RMM_DIR to the cpp folder of an RMM v25.08.00 checkout}"
bin=${RMM_REPLAY_BIN:-target/rmm_replay}
if [ ! -x "$bin" ] || [ "$here/rmm_replay.cpp" -nt "$bin" ]; then
    mkdir -p "$(dirname "$bin")"
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    "$nvcc" -O2 -std=c++17 -x cu -DNDEBUG -DLIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE \
        -I"$here/rmm_shim" -I"$RMM_DIR/include" \
        "$here/rmm_replay.cpp" "$RMM_DIR"/src/aligned.cpp "$RMM_DIR"/src/cuda_device.cpp \
        "$RMM_DIR"/src/cuda_stream.cpp "$RMM_DIR"/src/cuda_stream_view.cpp \
        -o "$bin" -lcudart
fi
exec "$bin" "$@"
