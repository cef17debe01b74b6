"""``--tune-malloc`` in a real engine process: the runner applies it (or not, with
``--no-tune-malloc``) and reports the path; the allocator then serves a large block from the
heap. Its effect on page faults is a benchmark figure (docs/benchmarks.md), not asserted here:
untuned counts vary run to run with glibc's dynamic thresholds."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from tiny_models import tiny_model

# one engine in a fresh process: the malloc path it reports, then the bytes glibc mmapped for
# a fresh 8 MiB block allocated after a batch
_ENGINE = """
import ctypes, sys
import torch
from radixserve import LLM, SamplingParams

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]

llm = LLM(model=sys.argv[2], tune_malloc=sys.argv[1] == "1", max_num_seqs=4)
print(llm.engine.runner.paths.paths["malloc"])
llm.generate([{"prompt_token_ids": list(range(1, 65))}] * 4,
             SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
info = ctypes.CDLL(None).mallinfo2
info.restype = MallInfo2
before = info().hblkhd
block = torch.ones(2 * 1024 * 1024)
print(info().hblkhd - before)
"""


def _engine(tuned: bool, model: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    return subprocess.Popen([sys.executable, "-c", _ENGINE, "1" if tuned else "0", model],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> tuple[str, int]:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err[-2000:]
    path, mmapped = out.split()[-2:]
    return path, int(mmapped)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_engine_applies_malloc_tuning(tmp_path) -> None:
    # A tiny checkpoint: the runner applies the tuning whatever the model (and the mmap
    # threshold it sets, 32 MiB, decides the 8 MiB block), so the default model's load would
    # only add time. Both engines run at once, each in its own process.
    model = tiny_model(tmp_path, "llama")
    tuned, untuned = _engine(True, model), _engine(False, model)
    try:
        path, mmapped = _result(tuned)
        assert path == "tuned"
        assert mmapped == 0  # an 8 MiB activation-sized block comes from the heap
        path, _ = _result(untuned)
        assert path == "default"
    finally:
        untuned.kill()
        untuned.wait()
