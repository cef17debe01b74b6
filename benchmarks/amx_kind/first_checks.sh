#!/usr/bin/env bash
# First checks on the Intel AMX kind (amx_bf16, amx_int8 in /proc/cpuinfo): the AMX code was
# written and tested on other kinds through scalar emulations of the tile instructions, so
# the hardware tiles run for the first time here. Run from the project root with the machine
# quiet; about 10 minutes. Writes JSON under $OUT (default /tmp/amx-checks).
#   bash benchmarks/amx_kind/first_checks.sh
set -euo pipefail
OUT="${OUT:-/tmp/amx-checks}"
mkdir -p "$OUT"
grep -o -m1 -E 'amx_bf16|amx_int8' /proc/cpuinfo || { echo "not the AMX kind" >&2; exit 1; }
py=.venv/bin/python

# 1. what the kernels' probes decided (each compares the tile unit with its emulation)
$py - <<'PY'
from radixserve.model_executor.kernels.cpu import CpuKernels
k = CpuKernels.load()
print("quant isa", k.quant.isa, "| AMX-INT8 tiles serve:", k.quant.amx_int8)
print("AMX bf16 GEMM:", k.amx.available, k.amx.self_check())
PY

# 2. the tests that run the tile instructions only where they exist, then the path tests
$py -m pytest -q -x tests/unit/test_quant_kernels.py -k amx tests/unit/test_amx_kernel.py \
    tests/integration/test_amx_linears.py

# 3. AMX-INT8 against the vpdpbusd tiles per type and row count (sets AMXQ_MIN_ROWS in
#    quant_kernels.c): Qwen2.5-1.5B's gate/up and 7B's down projection
for shape in "17920 1536" "3584 18944"; do
    set -- $shape
    .venv/bin/radixserve bench quant-kernels --n "$1" --k "$2" --m 1,4,8,16,32,64,256 \
        --types Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K --no-yardsticks --min-time 1 \
        --json "$OUT/quant-kernels-amx-$1x$2.json"
done
