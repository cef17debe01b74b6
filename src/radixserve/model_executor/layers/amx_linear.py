"""A projection through radixserve's AMX bfloat16 GEMM (``kernels/amx.py``) for every row count.

Why: on Intel Xeons with AMX, oneDNN's bf16 GEMM runs on AMX tiles and picks its K blocking by
the row count, so a row's bits change with the batch (from 2 rows up at a 7B model's shapes,
measured on the AMX kind), and radixserve's packed kernel cannot reproduce those sums (it copies
oneDNN's ordered ``vdpbf16ps`` chains, which the tiles do not follow). Owning the GEMM for
every M, prefill included, makes each row's arithmetic one fixed sequence: decode rows, verify
rows and prefill rows agree bit for bit, the way the other kinds' packed kernel makes them
agree. The bias is added after the product (``y += bias``), as on the packed path.
"""

from __future__ import annotations

import torch

from radixserve.model_executor.kernels.amx import AmxKernels


class AmxLinear:
    """``x [M, K] -> [M, N]`` bfloat16, W packed once into AMX's tile layout.

    Args:
        amx: the loaded AMX kernels (``CpuKernels.amx``).
        weight: bfloat16 [N, K]; packed here (the caller may free it after).
        bias: [N] bfloat16, or None.
        emulate: the scalar emulation of the tile instruction even where AMX runs (tests).

    Raises:
        ValueError: a weight or bias of another dtype or shape.
    """

    def __init__(self, amx: AmxKernels, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 emulate: bool = False) -> None:
        n, k = weight.shape
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,)):
            raise ValueError(f"bias must be bfloat16 [{n}], got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        self.amx, self.n, self.k = amx, n, k
        self.packed = amx.pack(weight.detach().contiguous())
        self.bias = bias
        self.emulate = emulate
        self.dtype = torch.bfloat16

    @property
    def ptr(self) -> int:
        """Address of the packed weight (the fused decode stack's table)."""
        return self.packed.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 -> [M, N] bfloat16.

        Raises:
            ValueError: x of another dtype or width.
        """
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"AMX linear needs [M, {self.k}], got {tuple(x.shape)}")
        y = self.amx.linear(x.contiguous(), self.packed, self.n, self.emulate)
        if self.bias is not None:
            y += self.bias
        return y
