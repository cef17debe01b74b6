#!/usr/bin/env bash
# Online figures on the GPU, set beside the seeds' baseline (Qwen2.5-0.5B on an RTX 3060, 8
# requests: ~1568 output tok/s, TTFT ~50 ms, TPOT ~4.44 ms): `radixserve serve` on the
# random-weight folder decode_bench.py built, then `radixserve bench serve` at concurrency 1 and 8.
# The load goes to /v1/chat/completions, as the baseline's did: the folder's stub tokenizer is
# replaced by the default model's (SmolLM2's, 49152 tokens, chat template included), which
# run.sh's caller copies into .gpu-tok/ here (fetch_wheels.sh does) and carries.
#
#   bash benchmarks/gpu/online.sh MODEL_DIR OUT_JSON_PREFIX [DEVICE]
#
# Run by run.sh's `online` phase (PYTHONPATH already holds the carried wheels and src/).
set -uo pipefail
MODEL=$1
PREFIX=$2
DEVICE=${3:-cuda}
PORT=${PORT:-8321}
TOK=${TOK:-.gpu-tok}
LOG=${SERVER_LOG:-/tmp/radixserve-online-server.log}
[[ -f $TOK/tokenizer.json ]] || { echo "no tokenizer in $TOK (run fetch_wheels.sh here, carry .gpu-tok)"; exit 1; }
cp "$TOK"/* "$MODEL"/
rs() { python3 -c 'import sys; from radixserve.cli import main; sys.exit(main())' "$@"; }

# python3 itself in the background (not a shell function's subshell), so the trap reaches it
python3 -c 'import sys; from radixserve.cli import main; sys.exit(main())' serve "$MODEL" --device "$DEVICE" --dtype bfloat16 --host 127.0.0.1 --port "$PORT" \
    --max-model-len 1024 --disable-log-requests >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; echo "-- server log tail"; tail -15 "$LOG"' EXIT
for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server exited"; exit 1; }
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server not healthy in 120 s"; exit 1; }
rc=0
for c in 1 8; do
    rs bench serve --base-url "http://127.0.0.1:$PORT" --endpoint chat --tokenizer "$MODEL" \
        --num-prompts $((c * 4)) --max-concurrency $c --random-input-len 128 \
        --random-output-len 256 --num-warmups 2 --disable-tqdm --label "c=$c" \
        --json "$PREFIX-c$c.json" | tail -40 || rc=$?
done
exit $rc
