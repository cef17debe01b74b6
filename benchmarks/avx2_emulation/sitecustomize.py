"""Loaded by every Python process started through ``run.sh`` (it puts this folder first on
PYTHONPATH): makes an AVX-512 machine run the code paths of the AVX2 kind, for benchmarks
and for running the test suite as on the AVX2 kind, never for serving.

* radixserve's C kernels are built with ``-march=haswell`` (AVX2 + FMA, no AVX-512): ``run.sh``
  sets ``CC`` to ``cc-haswell``, which reads the engine's ``-march=native`` so;
* torch and vLLM are told the CPU has no AVX-512 (vLLM then loads its ``_C_AVX2`` kernels),
  and Inductor vectorizes at 256 bits (AVX2);
* ``run.sh`` also caps oneDNN (``ONEDNN_MAX_CPU_ISA``), MKL and ATen at AVX2, and runs the
  command where /proc/cpuinfo lists no AVX-512 or AMX flag (``--dtype auto`` is float32).

What it cannot emulate: the AVX2 machines' cores (Zen 5 runs 256-bit code at full rate),
caches and memory bandwidth. Figures taken this way say "AVX-512 VM held to AVX2".
"""

import importlib.abc
import importlib.machinery
import os
import sys


class _HoldTorchToAvx2(importlib.abc.MetaPathFinder):
    """Patches ``torch.cpu`` as torch imports it, rather than importing torch into every
    process: a process that never imports torch must not get it from here (a test checks that
    loading a tokenizer does not import torch)."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - importlib's protocol
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            run(module)
            module._is_avx512_supported = lambda: False
            module._is_avx512_bf16_supported = lambda: False
            # Inductor's vector ISA follows ATEN_CPU_CAPABILITY (run.sh: avx2) among the ISAs
            # these report; importing its config here would import triton before a test could
            # set TRITON_INTERPRET

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("EMULATE_AVX2"):
    sys.meta_path.insert(0, _HoldTorchToAvx2())
