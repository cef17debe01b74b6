#!/usr/bin/env bash
# The one command to run on a GPU machine of the device tool (an H100 or H200, no package index).
#
# Before: here, `bash benchmarks/gpu/fetch_wheels.sh` (fills .whl/, ~12 MiB, ignored by git).
# Then one call of the device tool (everything in one call: a machine's start costs minutes):
#
#   run(command="bash benchmarks/gpu/run.sh all", carry=[".whl", ".gpu-tok"], timeout_s=600)
#
# Phases (first argument, default all), in this order, each under its own time limit:
#   `parity`  benchmarks/gpu/test_cuda_parity.py (PARITY_TIMEOUT, 150 s)
#   `bench`   benchmarks/gpu/decode_bench.py on Qwen2.5-0.5B's shapes, every backend x mode
#             (BENCH_TIMEOUT, 200 s)
#   `sampler` benchmarks/gpu/sampler_bench.py (where sampling measures best beside the graphs:
#             on the device after the graph, inside it, or on the host), then decode_bench.py on
#             the 0.5B folder with `--sampling random` (CUDA graphs, auto backend)
#             (SAMPLER_TIMEOUT, 150 s)
#   `spec`    decode_bench.py on the 0.5B folder with `--spec-draft-k 4` (a one-layer random
#             draft: every step verifies 4 drafts per request), the verify step's cost beside
#             a decode step's (SPEC_TIMEOUT, 150 s)
#   `online`  benchmarks/gpu/online.sh: `radixserve serve` + `bench serve` at c=1 and c=8 on that
#             folder, beside the seeds' RTX 3060 baseline (ONLINE_TIMEOUT, 80 s)
#   `shapes`  decode_bench.py on SHAPES (default qwen2.5-1.5b qwen2.5-7b smollm2-135m), CUDA
#             graphs and the auto backend only, until SHAPES_DEADLINE seconds after the start
#             (default 540)
#   `all`     parity, bench, online, shapes; a comma list (`parity,sampler,shapes`) runs those. Should it not end inside the call's 10 minutes, a second call runs what
#             is missing:
#
#   run(command="bash benchmarks/gpu/run.sh shapes", carry=[".whl", ".gpu-tok"], timeout_s=600)
#
# Extra arguments after the phase go to decode_bench.py (e.g. `bench --attention-backends
# triton --modes graphs`). What comes back, under $OUT (the tool returns at most 8 files):
# run.log (everything printed, the JUnit summary and the server's log tail included),
# parity.jsonl (per test: prompts exact / near-tie), decode_bench.json, online/*-c1.json and
# -c8.json, shapes/<shape>.json (each JSON written after each configuration, so a cut-off run
# keeps what it measured).
set -uo pipefail
cd "$(dirname "$0")/../.."

PHASE=${1:-all}
shift || true
for p in ${PHASE//,/ }; do
    case "$p" in all|parity|bench|sampler|spec|online|shapes) ;;
        *) echo "usage: run.sh [all|PHASE[,PHASE...]] [bench args]; PHASE: parity bench" \
               "sampler spec online shapes"; exit 2;; esac
done
want() { [[ $PHASE == all && $1 != sampler && $1 != spec ]] || [[ ,$PHASE, == *,$1,* ]]; }
START=$SECONDS
OUT=${OUT:-/tmp/radixserve-gpu-out}
mkdir -p "$OUT"
# the phases' own limits, inside the tool's 600 s (the wheel install and start-up take ~30 s)
PARITY_TIMEOUT=${PARITY_TIMEOUT:-150}
WHEELS_DIR=${WHEELS_DIR:-.whl}  # a local dry run of this script points it elsewhere
BENCH_TIMEOUT=${BENCH_TIMEOUT:-$([[ $PHASE == all ]] && echo 200 || echo 540)}
ONLINE_TIMEOUT=${ONLINE_TIMEOUT:-80}
SAMPLER_TIMEOUT=${SAMPLER_TIMEOUT:-150}
SPEC_TIMEOUT=${SPEC_TIMEOUT:-150}
SHAPES_DEADLINE=${SHAPES_DEADLINE:-540}
SHAPES=${SHAPES:-qwen2.5-1.5b qwen2.5-7b smollm2-135m}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}  # cpu: a local dry run (with --tiny in the bench args)
SAMPLER_ARGS=${SAMPLER_ARGS:-}  # e.g. "--vocab 4096 --batches 1,4" in a local dry run
MODEL_ROOT=${MODEL_ROOT:-/tmp}

main() {
    echo "== $(date -u +%FT%TZ) run.sh $PHASE $*"
    if compgen -G "$WHEELS_DIR/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$WHEELS_DIR"/*.whl || { echo "FATAL: wheel install failed"; return 1; }
        echo "installed $(ls "$WHEELS_DIR"/*.whl | wc -l) wheels into /tmp/site"
    else
        echo "WARNING: no wheels in $WHEELS_DIR (run fetch_wheels.sh here, carry .whl): the offline LLM needs msgspec"
    fi
    export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

    echo "== machine"
    nvidia-smi || echo "nvidia-smi failed"
    nproc; free -g | head -2
    python3 - <<'EOF'
import importlib
import sys

import torch

print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
      torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs",
          "capability", torch.cuda.get_device_capability(0))
for m in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "msgspec", "zmq",
          "gguf", "fastapi", "starlette", "pydantic", "uvicorn", "openai", "xgrammar",
          "radixserve"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')} ({mod.__file__})")
    except Exception as e:  # report, go on: only msgspec is needed for the offline LLM
        print(f"{m} IMPORT FAILED: {type(e).__name__}: {e}")
import radixserve.config as c

print("attention backends in this tree:", c.ATTENTION_BACKENDS)
EOF

    rc=0
    if want parity; then
        echo "== parity on CUDA (limit ${PARITY_TIMEOUT}s)"
        RADIXSERVE_GPU_PARITY_LOG="$OUT/parity.jsonl" timeout -k 10 "$PARITY_TIMEOUT" \
            python3 -m pytest -q -p no:cacheprovider -rs --timeout 120 \
            --junitxml=/tmp/parity.xml benchmarks/gpu/test_cuda_parity.py
        r=$?; echo "== parity exit $r"; [[ $r != 0 ]] && rc=$r
    fi
    if want bench; then
        echo "== decode bench (limit ${BENCH_TIMEOUT}s)"
        timeout -k 10 "$BENCH_TIMEOUT" python3 benchmarks/gpu/decode_bench.py \
            --device "$BENCH_DEVICE" --model-dir "$MODEL_ROOT/rs-qwen2.5-0.5b" \
            --out "$OUT/decode_bench.json" "$@"
        r=$?; echo "== bench exit $r"; [[ $r != 0 ]] && rc=$r
    fi
    if want sampler; then
        echo "== sampler (limit ${SAMPLER_TIMEOUT}s)"
        timeout -k 10 "$SAMPLER_TIMEOUT" bash -c "python3 benchmarks/gpu/sampler_bench.py \
            --device $BENCH_DEVICE --out $OUT/sampler_bench.json $SAMPLER_ARGS && \
            python3 benchmarks/gpu/decode_bench.py --device $BENCH_DEVICE --sampling random \
            --attention-backends auto --modes graphs --offline-prompts 64 \
            --model-dir $MODEL_ROOT/rs-qwen2.5-0.5b --out $OUT/decode_bench_random.json $*"
        r=$?; echo "== sampler exit $r"; [[ $r != 0 ]] && rc=$r
    fi
    if want spec; then
        echo "== spec (limit ${SPEC_TIMEOUT}s)"
        timeout -k 10 "$SPEC_TIMEOUT" python3 benchmarks/gpu/decode_bench.py \
            --device "$BENCH_DEVICE" --spec-draft-k 4 --attention-backends auto --modes graphs \
            --model-dir "$MODEL_ROOT/rs-qwen2.5-0.5b" --out "$OUT/decode_bench_spec.json" "$@"
        r=$?; echo "== spec exit $r"; [[ $r != 0 ]] && rc=$r
    fi
    if want online; then
        echo "== online (limit ${ONLINE_TIMEOUT}s)"
        if [[ -f $MODEL_ROOT/rs-qwen2.5-0.5b/config.json ]]; then
            mkdir -p "$OUT/online"
            timeout -k 10 "$ONLINE_TIMEOUT" bash benchmarks/gpu/online.sh \
                "$MODEL_ROOT/rs-qwen2.5-0.5b" "$OUT/online/qwen2.5-0.5b" "$BENCH_DEVICE"
            r=$?
        else
            echo "no model folder: the bench phase builds it"; r=1
        fi
        echo "== online exit $r"; [[ $r != 0 ]] && rc=$r
    fi
    if want shapes; then
        mkdir -p "$OUT/shapes"
        for shape in $SHAPES; do
            left=$((SHAPES_DEADLINE - (SECONDS - START)))
            if (( left < 30 )); then echo "== shape $shape: skipped, ${left}s left"; rc=1; continue; fi
            echo "== shape $shape (limit ${left}s)"
            timeout -k 10 "$left" python3 benchmarks/gpu/decode_bench.py --device "$BENCH_DEVICE" \
                --shape "$shape" --attention-backends auto --modes graphs \
                --model-dir "$MODEL_ROOT/rs-$shape" --out "$OUT/shapes/$shape.json" "$@"
            r=$?; echo "== shape $shape exit $r"; [[ $r != 0 ]] && rc=$r
            rm -rf "$MODEL_ROOT/rs-$shape"  # the disk holds one large model at a time
        done
    fi
    echo "== $(date -u +%FT%TZ) done, exit $rc"
    return $rc
}

main "$@" 2>&1 | tee -a "$OUT/run.log"
exit "${PIPESTATUS[0]}"
