#!/usr/bin/env bash
# The checks of one pool per device on a machine with a GPU, each beside
# its baseline: a build of the commit before (BASE, default gpu-main/, the
# same layout as gpu-bin/: tools/cumem-replay, benches/threads,
# tests/test-gpu, traces/, and its cumem_torch wheel) and this build
# (gpu-bin/ and .whl/ from scripts/gpu-suite.sh build).
#
#   scripts/one-pool-check.sh perf      # replays (warm), the peers' check, the thread pool:
#                                       # BASE and this build alternated, on a quiet machine
#   scripts/one-pool-check.sh soak      # starts the ten-minute soak in a session of its own
#                                       # (it outlives the call; `collect` waits for it)
#   scripts/one-pool-check.sh torch     # PyTorch programs on a machine where an older
#                                       # cumem_torch ran first (its native build cached):
#                                       # five processes of three var-length trainings, the
#                                       # other modes and thread caches, one process each
#   scripts/one-pool-check.sh repeat N  # the GPU tests of threads freeing each other's blocks,
#                                       # N times in a row, under load; memcheck once; the
#                                       # control (BASE's build of the same tests) must fail
#   scripts/one-pool-check.sh collect   # waits for the soak, copies its log
#
# Everything is written under $OUT (or one-pool-logs/).
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-gpu-main}
NEW=gpu-bin
out=${OUT:-one-pool-logs}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export CUMEM_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
command -v compute-sanitizer >/dev/null || export PATH=$PATH:/usr/local/cuda/bin

perf() {
    local r b seed pin=""
    # One core for the replays: a thread that moves between cores doubles
    # the time of some passes.
    command -v taskset >/dev/null && pin="taskset -c 3"
    for r in 1 2 3; do
        for b in "$BASE" "$NEW"; do
            (cd "$b" && timeout 300 $pin tools/cumem-replay -t sync_pool -r 3 --warm --no-progress --json \
                traces/*.csv.gz traces/synth/*.csv.gz) \
                >"$out/replay-$(basename "$b")-$r.json" 2>"$out/replay-$(basename "$b")-$r.err"
        done
    done
    for r in 1 2; do
        for b in "$BASE" "$NEW"; do
            CUMEM_BENCH_CHECK=peers timeout 240 "$b/benches/threads" --bench >"$out/peers-$(basename "$b")-$r.log" 2>&1
        done
    done
    for seed in 0x9001 0x9002 0x9003 0x9004; do
        for b in "$BASE" "$NEW"; do
            CUMEM_CHECK_SEED=$seed CUMEM_BENCH_CHECK=pool timeout 240 "$b/benches/threads" --bench \
                >"$out/pool-$(basename "$b")-$seed.log" 2>&1
        done
    done
    # The thread caches' settings beside the default (PERF_CONFS: a list
    # separated by spaces of CUMEM_CONF values).
    local conf n=0
    for conf in ${PERF_CONFS:-device_thread_cache=true}; do
        n=$((n + 1))
        echo "$conf" >"$out/conf-$n.txt"
        CUMEM_CONF=$conf CUMEM_BENCH_CHECK=peers timeout 240 "$NEW/benches/threads" --bench >"$out/peers-conf-$n.log" 2>&1
        for seed in 0x9001 0x9002; do
            CUMEM_CONF=$conf CUMEM_CHECK_SEED=$seed CUMEM_BENCH_CHECK=pool timeout 240 "$NEW/benches/threads" --bench \
                >"$out/pool-conf-$n-$seed.log" 2>&1
        done
    done
}

soak() {
    # A session of its own: it runs on after this call returns.
    setsid bash -c "SOAK_BIN=$NEW/soak timeout 900 $NEW/soak --secs 600 >/tmp/soak.log 2>&1; echo \"rc \$?\" >>/tmp/soak.log" \
        </dev/null >/dev/null 2>&1 &
    sleep 2
    echo "soak started"
}

collect() {
    while ! grep -q "^rc " /tmp/soak.log 2>/dev/null; do sleep 5; done
    cp /tmp/soak.log "$out/soak.log"
    tail -25 "$out/soak.log"
}

# Installs a wheel into a folder of its own; prints the folder.
install_wheel() {
    local whl=$1 dir=$2
    python3 -m pip install -q --no-deps --no-index --target "$dir" "$whl" >/dev/null || return 1
    echo "$dir"
}

torch_part() {
    local old new
    # An earlier cumem_torch first, its native backend compiled into the
    # default cache: the state of a user's machine.
    old=$(install_wheel "$(ls "$BASE"/cumem_torch-*.whl | head -1)" /tmp/cumem-old) || return 1
    PYTHONPATH=$old python3 -c "import cumem_torch._native as n; print('old build:', n.library()._name)" 2>&1 | tail -1
    new=$(install_wheel "$(ls .whl/cumem_torch-*.whl | head -1)" /tmp/cumem-new) || return 1
    local w=encoder_bucketed,seq2seq_varlen,gpt2_varlen i
    cd python/bench || return 1
    # PyTorch's own allocator once, for the values.
    timeout 300 python3 real_workloads.py --scale full --child "$w" pytorch "$out/torch-ref.json" >"$out/torch-ref.log" 2>&1 &
    for i in 1 2 3 4 5; do
        PYTHONPATH=$new timeout 300 python3 real_workloads.py --scale full --child "$w" cumem "$out/torch-default-$i.json" \
            >"$out/torch-default-$i.log" 2>&1 &
        [ $i = 2 ] && wait
    done
    wait
    local conf n=0
    for conf in mode=async_stream_ordered mode=cuda_async_pool device_thread_cache=true \
        mode=async_stream_ordered,device_thread_cache=true mode=cuda_async_pool,device_thread_cache=true; do
        n=$((n + 1))
        CUMEM_CONF=$conf PYTHONPATH=$new timeout 300 python3 real_workloads.py --scale full --child "$w" cumem \
            "$out/torch-conf-$n.json" >"$out/torch-conf-$n.log" 2>&1 &
        echo "$conf" >"$out/torch-conf-$n.conf"
        [ $n = 3 ] && wait
    done
    wait
    cd ../..
    python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
ref = {r["workload"]: r.get("values") for r in json.load(open(f"{out}/torch-ref.json"))} if os.path.exists(f"{out}/torch-ref.json") else {}
for f in sorted(glob.glob(f"{out}/torch-default-*.json") + glob.glob(f"{out}/torch-conf-*.json")):
    conf = open(f.replace(".json", ".conf")).read().strip() if os.path.exists(f.replace(".json", ".conf")) else "default"
    for r in json.load(open(f)):
        w = r["workload"]
        if "error" in r:
            print(f"{os.path.basename(f)} {conf} {w}: ERROR {r['error'][:200]}")
            continue
        same = r.get("values") == ref.get(w)
        print(f"{os.path.basename(f)} {conf} {w}: median {r['median_step_ms']:.1f} ms, peak physical "
              f"{r['peak_physical_bytes'] / 2**20:,.0f} MiB, values = PyTorch's: {same}")
PY
    for f in "$out"/torch-*.log; do grep -lE "Error|error" "$f" >/dev/null && { echo "== $f"; grep -E "Error|error" "$f" | head -5; }; done
}

repeat() {
    local n=${1:-100} t="$NEW/tests/test-gpu" names fails
    names=$("$t" --list --format terse 2>/dev/null |
        sed -n 's/^\(gpu_\(training_threads\|unmapped_pages\)::.*\): test$/\1/p' | tr '\n' ' ')
    echo "tests: $names"
    # The control: the commit before, with the same tests, must fail.
    if [ -x "$BASE/tests/test-gpu-control" ]; then
        timeout 300 "$BASE/tests/test-gpu-control" --test-threads=1 --exact \
            gpu_unmapped_pages::a_large_request_never_lands_on_unmapped_device_pages \
            gpu_training_threads::a_threaded_training_loop_keeps_every_live_block_on_the_device >"$out/control.log" 2>&1
        echo "control (the commit before): rc $? (must not be 0)"
        grep -E "panicked|test result|FAILED|unmapped|mismatch" "$out/control.log" | head -12
    fi
    # Load: every core busy with host work while four runs share the GPU.
    local load=() i
    for i in $(seq 1 "$(nproc)"); do (timeout 900 sh -c 'while :; do :; done') & load+=($!); done
    mkdir -p "$out/repeat"
    # shellcheck disable=SC2086 # one argument per test name
    seq 1 "$n" | xargs -P 4 -I{} sh -c "timeout 300 $t --test-threads=1 --exact $names >$out/repeat/{}.log 2>&1 || echo {} >>$out/repeat/failed"
    kill "${load[@]}" 2>/dev/null
    fails=0
    [ -f "$out/repeat/failed" ] && fails=$(wc -l <"$out/repeat/failed")
    echo "repeat: $((n - fails)) of $n passed under load"
    for i in $(cat "$out/repeat/failed" 2>/dev/null); do cp "$out/repeat/$i.log" "$out/repeat-fail-$i.log"; done
    grep -h "test result" "$out"/repeat/*.log | sort | uniq -c | head -5
    tar czf "$out/repeat.tar.gz" -C "$out" repeat && rm -rf "$out/repeat"
    # shellcheck disable=SC2086
    # The oracle's control asks the driver about addresses with nothing
    # mapped on purpose (an API error, not a memory error).
    timeout 400 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 "$t" --test-threads=1 --exact $names \
        >"$out/memcheck-new-tests.log" 2>&1
    echo "memcheck rc $?"; grep -E "ERROR SUMMARY|test result" "$out/memcheck-new-tests.log" | tail -3
}

case "${1:-}" in
perf) perf ;;
soak) soak ;;
collect) collect ;;
torch) torch_part ;;
repeat) shift; repeat "$@" ;;
*) echo "usage: $0 perf | soak | torch | repeat [N] | collect" >&2; exit 2 ;;
esac
