#!/usr/bin/env bash
# The one command to run on a GPU machine of the device tool (an H100 or H200, no package index).
#
# Before: here, `bash benchmarks/gpu/fetch_wheels.sh` (fills .whl/, ~12 MiB, ignored by git).
# Then one call of the device tool (everything in one call: a machine's start costs minutes):
#
#   run(command="bash benchmarks/gpu/run.sh all", carry=[".whl"], timeout_s=600)
#
# Phases (first argument, default all): `parity` (benchmarks/gpu/test_cuda_parity.py),
# `bench` (benchmarks/gpu/decode_bench.py), `all` (both). Should `all` not end inside the
# call's 10 minutes, a second call runs what is missing:
#
#   run(command="bash benchmarks/gpu/run.sh bench", carry=[".whl"], timeout_s=600)
#
# Extra arguments after the phase go to decode_bench.py (e.g. `bench --attention-backends
# triton --modes graphs`). What comes back, under $OUT (at most 8 files): run.log (everything
# printed), parity.xml (JUnit), parity.jsonl (per test: prompts exact / near-tie),
# decode_bench.json (the figures; written after each configuration, so a cut-off run keeps
# what it measured).
set -uo pipefail
cd "$(dirname "$0")/../.."

PHASE=${1:-all}
shift || true
case "$PHASE" in all|parity|bench) ;; *) echo "usage: run.sh [all|parity|bench] [bench args]"; exit 2;; esac
OUT=${OUT:-/tmp/radixserve-gpu-out}
mkdir -p "$OUT"
# the phases' own limits, inside the tool's 600 s (the wheel install and start-up take ~30 s)
PARITY_TIMEOUT=${PARITY_TIMEOUT:-240}
WHEELS_DIR=${WHEELS_DIR:-.whl}  # a local dry run of this script points it elsewhere
BENCH_TIMEOUT=${BENCH_TIMEOUT:-$([[ $PHASE == all ]] && echo 300 || echo 540)}

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
    if [[ $PHASE == all || $PHASE == parity ]]; then
        echo "== parity on CUDA (limit ${PARITY_TIMEOUT}s)"
        RADIXSERVE_GPU_PARITY_LOG="$OUT/parity.jsonl" timeout -k 10 "$PARITY_TIMEOUT" \
            python3 -m pytest -q -p no:cacheprovider -rs --timeout 120 \
            --junitxml="$OUT/parity.xml" benchmarks/gpu/test_cuda_parity.py
        r=$?; echo "== parity exit $r"; [[ $r != 0 ]] && rc=$r
    fi
    if [[ $PHASE == all || $PHASE == bench ]]; then
        echo "== decode bench (limit ${BENCH_TIMEOUT}s)"
        timeout -k 10 "$BENCH_TIMEOUT" python3 benchmarks/gpu/decode_bench.py \
            --out "$OUT/decode_bench.json" "$@"
        r=$?; echo "== bench exit $r"; [[ $r != 0 ]] && rc=$r
    fi
    echo "== $(date -u +%FT%TZ) done, exit $rc"
    return $rc
}

main "$@" 2>&1 | tee -a "$OUT/run.log"
exit "${PIPESTATUS[0]}"
