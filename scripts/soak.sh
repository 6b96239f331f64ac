#!/usr/bin/env bash
# The soak (cumem-c/examples/soak): everything a long-running program does
# to cumem at once, through the Rust API and the C ABI, every value checked,
# bounded in time. Build here, run on a machine with a GPU.
#
#   scripts/soak.sh build [DIR]          # here: release build, stripped copy in DIR (gpu-bin/)
#   scripts/soak.sh run [SECS] [ARGS]    # there: a SECS-second soak (SOAK_SECS, else 600);
#                                        # ARGS go to the binary (--report-secs N, --threads N)
#   scripts/soak.sh memcheck [SECS]      # there: compute-sanitizer memcheck over a light
#                                        # soak (60 s), the IPC child process included
#
# The binary is SOAK_BIN, else DIR/soak, else the release build. The log goes
# to $OUT (or soak-logs/); the exit status is the soak's: non-zero on any
# error, wrong value, or reserved memory not back at its start after release.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${2:-gpu-bin}
TARGET=${CARGO_TARGET_DIR:-target}

bin() {
    if [ -n "${SOAK_BIN:-}" ]; then echo "$SOAK_BIN"
    elif [ -x gpu-bin/soak ]; then echo gpu-bin/soak
    else echo "$TARGET/release/examples/soak"; fi
}

case "${1:-}" in
build)
    set -e
    cargo build --release -p cumem-c --example soak
    mkdir -p "$DIR"
    cp "$TARGET/release/examples/soak" "$DIR/soak"
    strip --strip-all "$DIR/soak"
    ls -l "$DIR/soak"
    ;;
run)
    shift
    secs=${1:-${SOAK_SECS:-600}}
    [ $# -gt 0 ] && shift
    out=${OUT:-soak-logs}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/soak-gpu.txt"
    CUMEM_REQUIRE_GPU=1 timeout $((secs + 300)) "$(bin)" --secs "$secs" "$@" 2>&1 | tee "$out/soak.log"
    exit "${PIPESTATUS[0]}"
    ;;
memcheck)
    shift
    secs=${1:-60}
    out=${OUT:-soak-logs}
    mkdir -p "$out"
    command -v compute-sanitizer >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
    CUMEM_REQUIRE_GPU=1 timeout $((secs * 4 + 300)) compute-sanitizer --tool memcheck --target-processes all \
        --error-exitcode 3 "$(bin)" --light --threads 3 --secs "$secs" --report-secs 20 \
        >"$out/soak-memcheck.log" 2>&1
    rc=$?
    grep -E "^soak: (steady|[0-9]+ ops|PASS|FAIL)|ERROR SUMMARY|ERROR|WRONG" "$out/soak-memcheck.log" | tail -40
    exit $rc
    ;;
*) echo "usage: $0 build [DIR] | run [SECS] [ARGS...] | memcheck [SECS]" >&2; exit 2 ;;
esac
