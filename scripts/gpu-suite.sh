#!/usr/bin/env bash
# The GPU suite: build here, run on a machine with a GPU.
#
#   scripts/gpu-suite.sh build: (here) the test, example, bench and tool binaries, stripped,
#     into gpu-bin/, and the cumem_torch wheel into .whl/.
#   scripts/gpu-suite.sh run [what...]: (there) runs them with CUMEM_REQUIRE_GPU=1; what is
#     tests, examples, nccl, benches, replay (the default: all five), or one of:
#     nccl: examples/nccl/ (--features nccl; NCCL found as below, CUMEM_REQUIRE_NCCL=1);
#     ddp: scripts/ddp.sh (torchrun, PyTorch's allocator and cumem_torch alternated; needs .whl/);
#     python: python/tests/smoke_one_manager.py (two installs, one native build),
#       smoke_same_peak.py (two processes, one peak), smoke_graph_pool.py (graphs and MemPool
#       at expandable segments' memory, values bit-identical); python3 or PYTHON with PyTorch;
#     tests-device1: the tests again with CUMEM_CONF=device=1 (two GPUs);
#     memcheck: compute-sanitizer over the GPU modules of tests/gpu/;
#     peers: cumem-replay/scripts/peers.sh (every trace through cumem, PyTorch's allocator
#       and, with RMM_DIR, RMM's pool; three rounds alternated);
#     bench:NAME; soak[:SECS] (cumem-c/examples/soak, 600 s by default, every value checked);
#     soak-memcheck (a light 60 s soak under memcheck); repeat:N (the threaded GPU tests N
#     times, four at a time, every core busy: they must never fail).
#
# Two GPUs: CUMEM_GPUS=2 scripts/gpu-suite.sh run tests tests-device1 examples
# (CUMEM_GPUS=2 makes the two-GPU tests fail instead of skipping when a GPU
# is missing). One GPU: scripts/gpu-suite.sh run tests examples
#
# gpu-bin/ and .whl/ are git-ignored; carry them to the GPU machine. Logs go to $OUT (or
# gpu-logs/) as one archive, gpu-logs.tar.gz.
#
# NCCL: cudarc 0.19 dlopen()s libnccl.so (and .so.13, .12, ...), never
# libnccl.so.2, NCCL's soname and often its only name on disk. The nccl
# part links libnccl.so to the first of $CUMEM_NCCL,
# /usr/lib/x86_64-linux-gnu/libnccl.so.2 and PyTorch's nvidia/nccl/lib in a
# folder of its own and puts that folder first on LD_LIBRARY_PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=gpu-bin
# Where cargo puts what it builds (CARGO_TARGET_DIR when set).
TARGET=${CARGO_TARGET_DIR:-target}

# "kind name test exe" of each executable in cargo's JSON messages on
# stdin (test: True for test harnesses).
executables() {
    python3 -c 'import json, sys
for m in map(json.loads, sys.stdin):
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["profile"]["test"], m["executable"])'
}

build() {
    set -e
    rm -rf "$BIN" && mkdir -p "$BIN/tests" "$BIN/examples" "$BIN/benches" "$BIN/tools" "$BIN/traces"
    # Test binaries (the library's own unit tests, tests/host/, tests/gpu/
    # and the tests/*.rs of a process of their own).
    cargo test --release --no-run --message-format=json 2>/dev/null | executables |
        while read -r kind name test exe; do
            # The C ABI crate's c_abi and header tests build C and C++ with
            # cargo and a compiler, or compare the header with cbindgen:
            # host tooling, run by .ci/run (its unit tests run here).
            case "$test:$kind:$name" in True:test:c_abi | True:test:header | True:bench:*) ;; True:*) cp "$exe" "$BIN/tests/$kind-$name" ;; esac
        done
    cargo build --release --examples --bins
    # The NCCL example needs the `nccl` feature (cudarc's NCCL bindings;
    # NCCL itself is loaded at run time).
    cargo build --release -p cumem --example nccl --features nccl
    for ex in examples/*.rs examples/*/main.rs cumem-replay/examples/*.rs; do
        [ -e "$ex" ] || continue
        case "$ex" in
        */main.rs) name=$(basename "$(dirname "$ex")") ;;
        *) name=$(basename "$ex" .rs) ;;
        esac
        cp "$TARGET/release/examples/$name" "$BIN/examples/$name"
    done
    cp "$TARGET/release/examples/soak" "$BIN/soak"
    for b in "$TARGET"/release/cumem-*; do
        [ -x "$b" ] && [ -f "$b" ] && cp "$b" "$BIN/tools/"
    done
    cargo bench --no-run --message-format=json 2>/dev/null | executables |
        while read -r kind name _ exe; do
            if [ "$kind" = bench ]; then cp "$exe" "$BIN/benches/$name"; fi
        done
    cp ../shared/traces/*.csv.gz "$BIN/traces/" 2>/dev/null || true
    # The synthetic traces as files, for the peers' replays (peers part).
    mkdir -p "$BIN/traces/synth"
    "$TARGET/release/cumem-synth" -d "$BIN/traces/synth" kv_cache:7 loop_depart pinned_top:2 moe two_streams \
        loop_fixed loop_change loop_two loop_lengths
    # The cumem_torch wheel for the ddp part, in .whl/ (carry it too).
    bash scripts/ddp.sh build
    strip --strip-all "$BIN"/soak "$BIN"/tests/* "$BIN"/examples/* "$BIN"/benches/* "$BIN"/tools/* 2>/dev/null || true
    du -sh "$BIN"
    ls -R "$BIN" | head -60
}

run() {
    # Logs are written to a folder of their own and bundled into one archive
    # under $OUT (only a few files come back from the device machine).
    local dest=${OUT:-gpu-logs}
    local out
    out=$(mktemp -d)
    mkdir -p "$dest"
    export CUMEM_REQUIRE_GPU=1
    local what=("$@")
    [ ${#what[@]} -eq 0 ] && what=(tests examples nccl benches replay)
    local failed=0
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee "$out/gpu.txt"
    echo "CUMEM_GPUS=${CUMEM_GPUS:-unset} CUMEM_CONF=${CUMEM_CONF:-unset}" | tee -a "$out/gpu.txt"
    for w in "${what[@]}"; do
        case "$w" in
        tests) run_tests "$out" "" || failed=1 ;;
        tests-device1) CUMEM_CONF=device=1 run_tests "$out" "-device1" || failed=1 ;;
        memcheck)
            command -v compute-sanitizer >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
            # The modules of tests/gpu/ that were GPU test binaries, each in
            # a process of its own, less the control that faults and the
            # tests that break a capture on purpose (API errors).
            local t="$BIN/tests/test-gpu" m
            for m in gpu_ipc multi_gpu gpu_graphs cudarc_interop managed_alloc gpu_remap gpu_threads gpu_training_threads gpu_dropped_streams staged_copy sleep; do
                local names
                names=$(module_tests "$t" "$m" | grep -v -e gpu_without_peer_access -e a_failed_cudarc_capture_releases_its_pool \
                    -e control_a_legacy_stream_sync_breaks_another_threads_global_capture)
                if [ -z "$names" ]; then
                    echo "FAILED: no tests of $m:: in $t"; failed=1; continue
                fi
                echo "== compute-sanitizer memcheck $t $m::"
                # shellcheck disable=SC2086 # one argument per test name
                if ! timeout 600 compute-sanitizer --tool memcheck --error-exitcode 3 "$t" --test-threads=1 --exact $names \
                    >"$out/memcheck-$m.log" 2>&1; then
                    echo "FAILED: memcheck $m"; failed=1
                fi
                grep -E "ERROR SUMMARY|test result" "$out/memcheck-$m.log" | tail -3
            done
            ;;
        examples)
            for e in "$BIN"/examples/*; do
                # The NCCL example runs in the nccl part, with NCCL found.
                [ "$(basename "$e")" = nccl ] && continue
                echo "== $e"
                if ! timeout 300 "$e" >"$out/example-$(basename "$e").log" 2>&1; then
                    echo "FAILED: $e"; failed=1
                fi
                tail -30 "$out/example-$(basename "$e").log"
            done
            ;;
        benches | bench:*)
            local benches=("$BIN"/benches/*)
            [ "$w" = benches ] || benches=("$BIN/benches/${w#bench:}")
            for b in "${benches[@]}"; do
                echo "== $b"
                timeout 400 "$b" --bench >"$out/bench-$(basename "$b").log" 2>&1 || { echo "FAILED: $b"; failed=1; }
                grep -vE "^(Benchmarking|Found|  [0-9]+ \(|Warning|\s*$)" "$out/bench-$(basename "$b").log" | tail -60
            done
            ;;
        nccl)
            local e="$BIN/examples/nccl" log="$out/example-nccl.log"
            echo "== $e"
            if [ ! -x "$e" ]; then
                echo "FAILED: $e is missing (scripts/gpu-suite.sh build makes it)"; failed=1
            elif ! nccl_library_path >"$out/nccl-lib.txt" 2>&1; then
                cat "$out/nccl-lib.txt"; echo "FAILED: no NCCL to run $e with"; failed=1
            else
                local libdir
                libdir=$(tail -1 "$out/nccl-lib.txt")
                echo "NCCL: $(head -1 "$out/nccl-lib.txt"), LD_LIBRARY_PATH starts with $libdir"
                if ! LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUMEM_REQUIRE_NCCL=1 \
                    NCCL_DEBUG=${NCCL_DEBUG:-WARN} CUMEM_NCCL_TIMEOUT_S=240 timeout 300 "$e" >"$log" 2>&1; then
                    echo "FAILED: $e"; failed=1
                fi
                tail -40 "$log"
            fi
            ;;
        python)
            local py=${PYTHON:-python3} t
            for t in python/tests/smoke_one_manager.py python/tests/smoke_same_peak.py python/tests/smoke_graph_pool.py; do
                echo "== $py $t"
                if ! timeout 540 "$py" "$t" >"$out/python-$(basename "$t" .py).log" 2>&1; then
                    echo "FAILED: $t"; failed=1
                fi
                tail -20 "$out/python-$(basename "$t" .py).log"
            done
            ;;
        ddp)
            if ! OUT="$out/ddp" bash scripts/ddp.sh run; then
                echo "FAILED: scripts/ddp.sh"; failed=1
            fi
            ;;
        soak | soak:*)
            local secs=${w#soak}
            secs=${secs#:}
            echo "== $BIN/soak, ${secs:-600} s"
            timeout $((${secs:-600} + 300)) "$BIN/soak" --secs "${secs:-600}" >"$out/soak.log" 2>&1 || { echo "FAILED: soak"; failed=1; }
            grep -E "^soak: (steady|[0-9]+ ops|PASS|FAIL)|ERROR|WRONG" "$out/soak.log" | tail -30
            ;;
        soak-memcheck)
            command -v compute-sanitizer >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
            echo "== compute-sanitizer memcheck $BIN/soak --light"
            timeout 900 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 3 "$BIN/soak" --light \
                --threads 3 --secs 60 --report-secs 20 >"$out/soak-memcheck.log" 2>&1 || { echo "FAILED: soak memcheck"; failed=1; }
            grep -E "^soak: ([0-9]+ ops|PASS|FAIL)|ERROR SUMMARY|ERROR|WRONG" "$out/soak-memcheck.log" | tail -20
            ;;
        repeat:*)
            local n=${w#repeat:} t="$BIN/tests/test-gpu" names load=() fails
            names=$(for m in gpu_threads gpu_training_threads gpu_unmapped_pages; do module_tests "$t" "$m"; done | tr '\n' ' ')
            for _ in $(seq "$(nproc)"); do timeout 900 sh -c 'while :; do :; done' & load+=($!); done
            fails=$(seq "$n" | xargs -P 4 -I{} sh -c "timeout 300 $t --test-threads=1 --exact $names >$out/repeat-{}.log 2>&1 || echo {}" | wc -l)
            kill "${load[@]}" 2>/dev/null
            echo "repeat: $((n - fails)) of $n passed with every core busy"
            [ "$fails" = 0 ] || failed=1
            ;;
        replay)
            tool="$BIN/tools/cumem-replay"
            echo "== $tool: cold (fresh allocator per replay), every target"
            "$tool" --no-progress --target all,sim_device --plot "$out/replay.svg" "$BIN"/traces/*.csv.gz 2>&1 | tee "$out/replay.log" | tail -24
            echo "== $tool: warm (the pool already holds its memory)"
            "$tool" --no-progress --warm --target all,sim_device "$BIN"/traces/*.csv.gz 2>&1 | tee "$out/replay-warm.log" | tail -20
            echo "== $tool: sync pool with device thread caches, cold and warm"
            for warm in "" --warm; do
                "$tool" --no-progress $warm --conf device_thread_cache=true --target sync_pool "$BIN"/traces/*.csv.gz 2>&1 |
                    tee -a "$out/replay-cache.log" | tail -4
            done
            ;;
        peers)
            # RMM's replay is built there with nvcc (RMM_DIR: the cpp folder
            # of an RMM checkout at v25.08.00; without it RMM is left out).
            CUMEM_REPLAY="$BIN/tools/cumem-replay" RMM_REPLAY_BIN="$(mktemp -d)/rmm_replay" \
                cumem-replay/scripts/peers.sh 3 "$out/peers" "$BIN"/traces/*.csv.gz cumem-replay/traces/*.csv.gz \
                "$BIN"/traces/synth/*.csv.gz 2>&1 | tee "$out/peers.log" | tail -50
            grep -q "^| trace" "$out/peers.log" || { echo "FAILED: peers"; failed=1; }
            ;;
        *) echo "unknown part: $w"; failed=1 ;;
        esac
    done
    tar czf "$dest/gpu-logs.tar.gz" -C "$out" . && echo "logs: $dest/gpu-logs.tar.gz"
    [ $failed = 0 ] && echo "GPU SUITE: PASSED" || echo "GPU SUITE: FAILED"
    return $failed
}

# Finds NCCL for cudarc: prints the library used, then a fresh folder
# holding a libnccl.so link to it (for LD_LIBRARY_PATH); fails without.
nccl_library_path() {
    local so dir
    for so in ${CUMEM_NCCL:-} /usr/lib/x86_64-linux-gnu/libnccl.so.2 \
        /opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2 \
        /usr/local/cuda/lib64/libnccl.so.2; do
        if [ -e "$so" ]; then
            dir=$(mktemp -d /tmp/cumem-nccl.XXXXXX)
            ln -s "$(readlink -f "$so")" "$dir/libnccl.so"
            echo "$so"
            echo "$dir"
            return 0
        fi
    done
    echo "no libnccl.so.2 in any of: ${CUMEM_NCCL:-} /usr/lib/x86_64-linux-gnu /opt/torch/.venv/.../nvidia/nccl/lib /usr/local/cuda/lib64 (CUMEM_NCCL=path names another)"
    return 1
}

# The top-level modules of a test binary (one per line): tests/host/ and
# tests/gpu/ gather what were test binaries of their own, one module each.
test_modules() {
    "$1" --list --format terse 2>/dev/null | sed -n 's/^\([A-Za-z0-9_]*\)::.*: test$/\1/p' | sort -u
}

# The full names of the tests of module $2 (and its submodules) in binary $1.
module_tests() {
    "$1" --list --format terse 2>/dev/null | sed -n "s/^\($2::.*\): test\$/\1/p"
}

# Runs every test binary; the integration test crates of modules run one
# module per process, as when each module was a binary of its own (tests
# of different files never share a process or the GPU at once). Logs are
# named after the binary (and module) plus $2.
run_tests() {
    local out=$1 suffix=$2 failed=0
    for t in "$BIN"/tests/*; do
        # The replay tool's tests run its programs from the build tree and
        # need no GPU: `cargo test` runs them where they were built.
        case "$(basename "$t")" in test-replay) echo "== $t: skipped (runs the tool binaries of the build tree; no GPU part)"; continue ;; esac
        local mods=""
        case "$(basename "$t")" in test-*) mods=$(test_modules "$t") ;; esac
        if [ -z "$mods" ]; then
            run_one "$out" "$suffix" "$t" "" || failed=1
            continue
        fi
        local m
        for m in $mods; do
            # shellcheck disable=SC2046 # one argument per test name
            run_one "$out" "$suffix" "$t" "$m" --exact $(module_tests "$t" "$m") || failed=1
        done
    done
    return $failed
}

# Runs test binary $3 (module $4, or all of it), with the rest as its
# arguments; the log is $1/<binary>[-<module>]$2.log.
run_one() {
    local out=$1 suffix=$2 t=$3 m=$4
    shift 4
    local log="$out/$(basename "$t")${m:+-$m}$suffix.log"
    echo "== $t${m:+ $m::}${CUMEM_CONF:+ (CUMEM_CONF=$CUMEM_CONF)}"
    if ! "$t" --test-threads=4 "$@" >"$log" 2>&1; then
        echo "FAILED: $t${m:+ $m::}"; tail -40 "$log"; return 1
    fi
    grep -E "test result|skipped" "$log" | tail -3
}

case "${1:-}" in
build) build ;;
run) shift; run "$@" ;;
*) echo "usage: $0 build | run [tests|tests-device1|memcheck|examples|nccl|python|ddp|benches|bench:NAME|replay|peers|soak[:SECS]|soak-memcheck|repeat:N]..." >&2; exit 2 ;;
esac
