#!/bin/bash
# Replays traces through cumem, PyTorch's caching allocator and RMM's pool
# on one machine, alternated round by round, warm and cold, and prints the
# table of `peers_table.py`.
#
#     RMM_DIR=... cumem-replay/scripts/peers.sh ROUNDS OUTDIR TRACE.csv.gz ...
#
# Each round runs, in turn: cumem (`cumem-replay -t sync_pool -r 3
# --warm`, then the same cold), `torch_replay.py`, `rmm_replay.sh`; the
# order rotates from round to round, so that no allocator always runs
# first. Each writes JSON into OUTDIR. CUMEM_REPLAY names the replay tool
# (default target/release/cumem-replay). Without RMM_DIR (see
# rmm_replay.sh) RMM is left out, and its columns stay empty.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rounds=${1:?rounds}
out=${2:?output folder}
shift 2
[ $# -gt 0 ] || { echo "no traces" >&2; exit 2; }
tool=${CUMEM_REPLAY:-target/release/cumem-replay}
python=${PYTHON:-python3}
mkdir -p "$out"
run_one() {
    local who=$1 r=$2
    shift 2
    case $who in
    cumem)
        timeout 900 "$tool" -t sync_pool -r 3 --warm --no-progress --json "$@" > "$out/cumem-warm-$r.json" 2> "$out/cumem-warm-$r.err"
        timeout 900 "$tool" -t sync_pool -r 3 --no-progress --json "$@" > "$out/cumem-cold-$r.json" 2> "$out/cumem-cold-$r.err"
        ;;
    torch) timeout 900 "$python" "$here/torch_replay.py" "$@" > "$out/torch-$r.jsonl" 2> "$out/torch-$r.err" ;;
    rmm)
        if [ -z "${RMM_DIR:-}" ]; then
            echo "round $r: rmm skipped (RMM_DIR unset)" >&2
            return 0
        fi
        timeout 900 "$here/rmm_replay.sh" "$@" > "$out/rmm-$r.jsonl" 2> "$out/rmm-$r.err"
        ;;
    esac
}
order=(cumem torch rmm)
for r in $(seq 1 "$rounds"); do
    for who in "${order[@]}"; do
        run_one "$who" "$r" "$@" || echo "round $r: $who failed ($?)" >&2
        echo "round $r: $who done $(date +%T)" >&2
    done
    order=("${order[@]:1}" "${order[0]}")
done
"$python" "$here/peers_table.py" "$out"
