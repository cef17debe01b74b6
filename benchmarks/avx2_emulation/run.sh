#!/usr/bin/env bash
# Run a command as on the AVX2 kind, on an AVX-512 machine (see sitecustomize.py):
#   bash benchmarks/avx2_emulation/run.sh .venv/bin/radixserve bench compare --dtype float32 ...
#   bash benchmarks/avx2_emulation/run.sh make test
# The command runs in its own mount namespace where /proc/cpuinfo lists no AVX-512, AMX or
# other post-AVX2 vector flags, so whatever reads the flags (`--dtype auto` -> float32, the
# per-machine cache keys, the tests' choice of kernel builds) sees the AVX2 kind. That needs
# root or unprivileged user namespaces; without either the script stops with an error.
# Its own cache folder: the per-machine measurements (path_choice) must not mix with the
# machine's own.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ "${EMULATE_AVX2_NS:-}" != 1 ]]; then
    fake="$(mktemp /tmp/cpuinfo-avx2.XXXXXX)"
    trap 'rm -f "$fake"' EXIT
    # drop every AVX-512 and AMX flag and the wider-vector extensions an AVX2 CPU lacks;
    # the model name says so, which also changes the cache keys built from it
    sed -E -e '/^flags|^vmx flags/ { s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni|vaes|vpclmulqdq|gfni)\b//g }' \
        -e 's/^(model name\s*:.*)$/\1 (held to AVX2)/' /proc/cpuinfo > "$fake"
    if [[ $(id -u) == 0 ]]; then ns=(unshare --mount --propagation private)
    else ns=(unshare --map-root-user --mount --propagation private); fi
    if ! "${ns[@]}" true 2>/dev/null; then
        echo "run.sh: cannot make a mount namespace (needs root or user namespaces)" >&2
        exit 1
    fi
    status=0
    EMULATE_AVX2_NS=1 "${ns[@]}" bash -c 'mount --bind "$1" /proc/cpuinfo && shift && exec bash "$@"' \
        _ "$fake" "${BASH_SOURCE[0]}" "$@" || status=$?
    exit "$status"
fi

export EMULATE_AVX2=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export RADIXSERVE_CACHE_DIR="${RADIXSERVE_CACHE_DIR:-$HOME/.cache/radixserve-avx2-emulation}"
# the kernels' -march=native would still be this CPU's (GCC asks cpuid, not /proc/cpuinfo)
export CC="$here/cc-haswell"
exec "$@"
