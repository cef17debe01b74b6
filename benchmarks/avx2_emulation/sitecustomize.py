"""Loaded by every Python process started through ``run.sh`` (it puts this folder first on
PYTHONPATH): makes an AVX-512 machine run the code paths of the AVX2 kind, for benchmarks
only, never for tests or serving.

* radixserve's C kernels are built with ``-march=haswell`` (AVX2 + FMA, no AVX-512);
* torch and vLLM are told the CPU has no AVX-512 (vLLM then loads its ``_C_AVX2`` kernels),
  and Inductor vectorizes at 256 bits;
* ``run.sh`` also caps oneDNN (``ONEDNN_MAX_CPU_ISA``), MKL and ATen at AVX2.

What it cannot emulate: the AVX2 machines' cores (Zen 5 runs 256-bit code at full rate),
caches and memory bandwidth. Figures taken this way say "AVX-512 VM held to AVX2".
"""

import os

if os.environ.get("EMULATE_AVX2"):
    try:
        import torch

        torch.cpu._is_avx512_supported = lambda: False
        torch.cpu._is_avx512_bf16_supported = lambda: False
        try:
            import torch._inductor.config as inductor_config

            inductor_config.cpp.simdlen = 256
        except ImportError:
            pass
    except ImportError:
        pass
    try:
        from radixserve.model_executor.kernels import cpu as _cpu

        _load = _cpu.CpuKernels.load.__func__
        _cpu.CpuKernels.load = classmethod(lambda cls, march="haswell": _load(cls, march))
    except ImportError:
        pass
