#!/usr/bin/env bash
# Download, into .whl/ at the repo root, the wheels of every runtime dependency radixserve needs
# that the GPU machines' image ('cuda', /work/.library/device/KINDS.md) lacks: Python 3.12,
# manylinux x86_64, one version of each (two versions of one project stop the install there).
# Run it here, where pip reaches a package index; the GPU machine has none. Then pass
# carry=[".whl", ".gpu-tok"] to the device tool's `run` (benchmarks/gpu/run.sh installs them).
# It also copies the default model's tokenizer files into .gpu-tok/ (ignored by git), which
# benchmarks/gpu/online.sh puts into the random-weight folder it serves (chat template included).
#
#   bash benchmarks/gpu/fetch_wheels.sh          # downloads, then checks the set (--check)
#   bash benchmarks/gpu/fetch_wheels.sh --check  # only checks what .whl/ holds
#
# The pins are the versions of this repo's tested .venv (pyproject.toml `dependencies`, plus
# openai from the test extra for the OpenAI-client smoke checks, plus each wheel's own
# Requires-Dist that the image lacks or may hold too old). radixserve itself travels as source:
# the kit runs it with PYTHONPATH=/tmp/site:src.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-}
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

# name==version: each line's comment says who needs it
WHEELS=(
    msgspec==0.22.0                # radixserve (runner, engine types): needed by the offline LLM
    pyzmq==27.3.0                  # radixserve (engine process sockets, server)
    gguf==0.19.0                   # radixserve (GGUF loader); needs numpy pyyaml requests tqdm (image)
    fastapi==0.165.0               # radixserve (server)
    starlette==1.10.0              # fastapi
    opentelemetry-api==1.45.2      # fastapi
    pydantic==2.14.3               # fastapi, openai, xgrammar
    pydantic-core==2.50.4          # pydantic (exact pin)
    annotated-types==0.8.0         # pydantic
    typing-inspection==0.4.5       # pydantic, fastapi
    typing-extensions==4.16.0      # pydantic-core and anyio need >= 4.16; the image's may be older
    anyio==4.16.0                  # openai and httpx2 need >= 4.10; the image's version is unknown
    uvicorn==0.54.0                # radixserve (server); needs click h11 (image)
    h11==0.16.0                    # httpcore2 needs >= 0.16; the image's version is unknown
    xgrammar==0.2.8                # radixserve (structured outputs, loaded at first use)
    apache-tvm-ffi==0.1.15.post2   # xgrammar
    openai==3.54.0                 # test extra: OpenAI-client checks against the server
    httpx2==2.16.2                 # openai
    httpcore2==2.16.2              # httpx2 (exact pin)
    truststore==0.10.5             # httpx2, httpcore2
    idna==3.20                     # httpx2 needs >= 3.18; the image's version is unknown
    jiter==0.19.0                  # openai
    distro==1.9.0                  # openai
    sniffio==1.3.1                 # openai
)

if [[ "${1:-}" != "--check" ]]; then
    mkdir -p .gpu-tok
    tok=$("$PY" -c 'from radixserve.model_executor.loader import resolve_model; print(resolve_model(None).folder)')
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
        [[ -f $tok/$f ]] && cp "$tok/$f" .gpu-tok/
    done
    echo ".gpu-tok/: the default model's tokenizer from $tok"
    mkdir -p .whl
    # manylinux_2_N tags are matched exactly: name every N the pinned wheels use
    plats=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
             manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
             manylinux_2_5_x86_64 manylinux1_x86_64; do
        plats+=(--platform "$p")
    done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plats[@]}" -d .whl "${WHEELS[@]}"
fi

# Check: one wheel per project, and every Requires-Dist (markers evaluated for CPython 3.12 on
# Linux x86_64, extras skipped) met by a wheel here or by a package of the image.
"$PY" - "${WHEELS[@]}" <<'EOF'
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

# the image's packages as KINDS.md lists them (2026-11-17); versions unknown there
IMAGE = set(map(canonicalize_name, """absl-py accelerate aiofiles aiohappyeyeballs aiohttp
aiosignal annotated-doc anyio attrs botorch build certifi charset-normalizer chex click
cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore
httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader
lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken
timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()))

env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
pins = {canonicalize_name(p.split("==")[0]): p.split("==")[1] for p in sys.argv[1:]}
have: dict[str, list[tuple[str, Version, list[str]]]] = {}
total = 0
for whl in sorted(Path(".whl").glob("*.whl")):
    total += whl.stat().st_size
    with zipfile.ZipFile(whl) as z:
        meta_name = next(n for n in z.namelist()
                         if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = Parser().parsestr(z.read(meta_name).decode())
    name = canonicalize_name(meta["Name"])
    have.setdefault(name, []).append((whl.name, Version(meta["Version"]),
                                      meta.get_all("Requires-Dist") or []))
bad = []
for name, entries in have.items():
    if len(entries) > 1:
        bad.append(f"{name}: {len(entries)} wheels ({', '.join(e[0] for e in entries)})")
    if name not in pins:
        bad.append(f"{name}: a wheel no pin names ({entries[0][0]})")
for name, version in pins.items():
    if name not in have:
        bad.append(f"{name}=={version}: no wheel in .whl/")
for name, entries in sorted(have.items()):
    for req_s in entries[0][2]:
        req = Requirement(req_s)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # another platform, or an extra
        dep = canonicalize_name(req.name)
        if dep in have:
            v = have[dep][0][1]
            if req.specifier and v not in req.specifier:
                bad.append(f"{name} needs {req}, .whl/ has {dep} {v}")
        elif dep not in IMAGE:
            bad.append(f"{name} needs {req}: neither in .whl/ nor in the image")
print(f".whl/: {sum(map(len, have.values()))} wheels, {total / 2**20:.1f} MiB")
if bad:
    print("problems:\n  " + "\n  ".join(bad))
    sys.exit(1)
print("every pin present once; every Requires-Dist met by .whl/ or the image's package list "
      "(the image's versions are not known here: run.sh imports each module there)")
EOF
