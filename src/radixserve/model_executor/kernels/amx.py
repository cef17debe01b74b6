"""ctypes wrapper of ``csrc/amx_kernels.c``: radixserve's bfloat16 GEMM on Intel AMX tiles, one
reduction order per output for every row count (so batch invariant by construction), built into
the same shared object as the other CPU kernels (``cpu.build``); ``CpuKernels.load().amx`` is
an instance.

A weight is packed once at load (``pack``) into the tile layout the C source's header gives
(panels of 64 outputs, blocks of 32 K values, AMX's pair-interleaved B tiles; N and K padded
with zeros), and every call of ``linear``, whatever its M, sums each output over the K blocks
in order, one ``TDPBF16PS`` per block. On a CPU without AMX (or with ``emulate``) the same loops
run on a scalar emulation of the tile instruction: that checks the layout anywhere, and its
bits are the emulation's, not the hardware's.
"""

from __future__ import annotations

import ctypes

import torch

_ERRORS = {1: "bad sizes", 3: "out of memory"}


class AmxKernels:
    """The AMX entry points of a loaded kernel library (``CpuKernels.amx``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn = lib.rs_amx_available
        fn.argtypes = []
        fn.restype = c_int
        #: whether the tile path runs here: a CPU with AMX-TILE and AMX-BF16, Linux granted
        #: the process the tile state, a build with the intrinsics
        self.available = bool(fn())
        fn = lib.rs_amx_packed_bytes
        fn.argtypes = [i64, i64]
        fn.restype = i64
        self._bytes = fn
        fn = lib.rs_amx_pack_bf16
        fn.argtypes = [ptr, i64, i64, ptr]
        fn.restype = c_int
        self._pack = fn
        fn = lib.rs_amx_linear_bf16
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, c_int, c_int]
        fn.restype = c_int
        self._linear = fn
        self._check: tuple[bool, str] | None = None

    def self_check(self) -> tuple[bool, str]:
        """Whether the tile path may serve here, and why: available, and on a probe weight
        (130 x 1536, N and K padded) the hardware's rows agree with the scalar emulation to
        bfloat16 rounding and give the same bits alone as in a batch of 37. Run once (a few
        ms); the engine falls back to oneDNN where it fails, saying why."""
        if self._check is None:
            if not self.available:
                self._check = (False, "no AMX-TILE/AMX-BF16 here, or Linux refused the tile "
                                      "state")
            else:
                g = torch.Generator().manual_seed(0)
                w = (torch.randn(130, 1536, generator=g) * 0.05).bfloat16()
                x = torch.randn(37, 1536, generator=g).bfloat16()
                packed = self.pack(w)
                y = self.linear(x, packed, 130)
                emu = self.linear(x, packed, 130, emulate=True)
                alone = torch.cat([self.linear(x[i:i + 1].contiguous(), packed, 130)
                                   for i in range(37)])
                err = float(((y.float() - emu.float()).abs()
                             / (emu.float().abs() + 1e-2)).max())
                if not torch.equal(alone, y):
                    self._check = (False, "the AMX tile path gave a row other bits alone than "
                                          "in a batch (a kernel bug): keeping oneDNN")
                elif not err < 0.02:
                    self._check = (False, f"the AMX tile path disagrees with its emulation "
                                          f"(relative error {err:.3g}; a kernel bug): keeping "
                                          "oneDNN")
                else:
                    self._check = (True, "the tile path agrees with its emulation and is "
                                         "batch invariant on a probe weight")
        return self._check

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The tile layout of a bfloat16 weight.

        Args:
            weight: contiguous bfloat16 [N, K] on CPU. Not modified.
        Returns: a new bfloat16 tensor of N rounded up to 64 times K rounded up to 32 values.

        Raises:
            ValueError: another dtype, device, rank or layout.
        """
        if (weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu"
                or not weight.is_contiguous() or min(weight.shape) <= 0):
            raise ValueError(f"AMX packing needs a contiguous bfloat16 [N, K] CPU weight, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        n, k = weight.shape
        out = torch.empty(self._bytes(n, k) // 2, dtype=torch.bfloat16)
        rc = self._pack(weight.data_ptr(), n, k, out.data_ptr())
        if rc:
            raise RuntimeError(f"AMX packing failed with code {rc}")
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               emulate: bool = False) -> torch.Tensor:
        """``x @ W.T`` for a weight W [n, K] packed by ``pack``.

        Args:
            x: contiguous bfloat16 [M, K] on CPU.
            packed: ``pack(W)``.
            n: W's rows (output features).
            emulate: run the scalar emulation of the tile instruction even where AMX runs.
        Returns: a new bfloat16 [M, n] tensor; row i depends on row i of x only.

        Raises:
            ValueError: wrong dtype, shape or layout (``packed`` of another size).
            RuntimeError: the kernel's error code (1 bad sizes, 3 out of memory).
        """
        if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() \
                or x.device.type != "cpu":
            raise ValueError(f"AMX linear needs contiguous bfloat16 [M, K] on CPU, got "
                             f"{x.dtype} {tuple(x.shape)}")
        m, k = x.shape
        if packed.dtype != torch.bfloat16 or packed.numel() * 2 != self._bytes(n, k):
            raise ValueError(f"packed holds {packed.numel()} bfloat16 values, not the tile "
                             f"layout of a [{n}, {k}] weight")
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self.linear_unchecked(x.data_ptr(), m, k, packed.data_ptr(), n, out.data_ptr(), n,
                              emulate)
        return out

    def linear_unchecked(self, x_ptr: int, m: int, k: int, packed_ptr: int, n: int,
                         out_ptr: int, ldo: int, emulate: bool = False) -> None:
        """``linear`` on raw addresses (out row stride ``ldo`` elements) for a caller that
        checked the tensors once.

        Raises:
            RuntimeError: the kernel's error code.
        """
        rc = self._linear(x_ptr, m, k, packed_ptr, n, out_ptr, ldo, 1 if emulate else 0,
                          torch.get_num_threads())
        if rc:
            raise RuntimeError(f"AMX linear kernel failed with code {rc} "
                               f"({_ERRORS.get(rc, 'unknown')})")
