#!/usr/bin/env bash
# Run a benchmark command as on the AVX2 kind, on an AVX-512 machine (see sitecustomize.py):
#   bash benchmarks/avx2_emulation/run.sh .venv/bin/radixserve bench compare --dtype float32 ...
# Its own cache folder: the per-machine measurements (path_choice) are keyed by /proc/cpuinfo,
# which the emulation does not change, so they must not mix with the machine's own.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export EMULATE_AVX2=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export RADIXSERVE_CACHE_DIR="${RADIXSERVE_CACHE_DIR:-$HOME/.cache/radixserve-avx2-emulation}"
exec "$@"
