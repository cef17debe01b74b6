"""Weight-only int8 with one scale per output channel (``--quantization int8``).

A float checkpoint's projections (and its LM head) are quantized at load, a block of rows at a
time as they stream from the file: per output row, ``scale = max|w| / 127`` and ``q =
round(w / scale)`` in [-127, 127] (symmetric, as torch.ao's int8 weight-only and vLLM's
per-channel int8 schemes). Activations stay in float: ``rs_linear_f32_i8w`` widens the int8
values to float32 in registers, runs the float32 GEMM's chain of FMAs per output (the same for
every row count, so a row's result never depends on the batch) and multiplies each sum by its
output's scale once. A decode step reads a quarter of float32's weight bytes (half of bf16's),
which is what bounds it once the weights leave the cache.

Under bfloat16 activations the rows are widened to float32 for the product and the outputs
rounded back to bfloat16 (the fused decode stack does the same in C, so the bits agree).
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.model_executor.kernels.quant import QuantKernels

#: outputs per packed panel (the float32 kernel's [N/64][K][64] layout)
BLOCK_N = 64
#: ``Segment.ggml_type`` of rows quantized to int8 per output channel (not a ggml type)
INT8_CHANNEL = -8
_DTYPES = (torch.float32, torch.bfloat16)


def quantize_per_channel(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows ``[R, K]`` -> (int8 ``[R, K]``, float32 scales ``[R]``) with
    ``rows[r] ~= q[r] * scale[r]``: ``scale = max|row| / 127`` (float32), ``q =
    round(row / scale)`` (ties to even, within [-127, 127]); an all-zero row gets scale 0 and
    zeros. Each value is off by at most ``scale / 2``."""
    w = rows.float()
    scale = w.abs().amax(dim=1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8WeightLinear:
    """``x [M, K] -> (x @ Wq.T) * scale (+ bias) [M, N]`` with Wq int8 and one float32 scale
    per output.

    Args:
        quant: the loaded quantized kernels (``has_int8w`` true).
        qweight: int8 [N, K]; copied into the packed layout ``[ceil(N/64), K, 64]``, padded
            with zero rows to a whole panel (the caller may free it).
        scale: float32 [N], output n's scale.
        bias: [N] in the activation dtype, added after the product (as torch adds it), or None.

    Raises:
        ValueError: a weight that is not int8 2-D, a scale or bias of the wrong shape or
            dtype, or a build without the float32 GEMM.
    """

    kind = "int8"

    def __init__(self, quant: QuantKernels, qweight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or 0 in qweight.shape:
            raise ValueError(f"int8-weight linear needs an int8 [N, K] weight, got "
                             f"{qweight.dtype} {tuple(qweight.shape)}")
        n, k = qweight.shape
        if scale.dtype != torch.float32 or tuple(scale.shape) != (n,):
            raise ValueError(f"scale must be float32 [{n}], got {scale.dtype} "
                             f"{tuple(scale.shape)}")
        if bias is not None and (bias.dtype not in _DTYPES or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias must be float32/bfloat16 [{n}], got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        if not quant.has_int8w:
            raise ValueError("int8-weight linear needs radixserve's float32 GEMM (AVX2 + FMA)")
        self.quant, self.n, self.k = quant, n, k
        #: one chain of FMAs per output over all of K
        self.k_block = k
        #: outputs the kernel computes: N rounded up to whole panels (a tensor-parallel
        #: shard of 80 rows, say); the padding's outputs are zeros, cut off
        self.n_padded = -(-n // BLOCK_N) * BLOCK_N
        pad = self.n_padded - n
        q = qweight.detach()
        scale = scale.detach()
        if pad:
            q = torch.cat([q, q.new_zeros(pad, k)])
            scale = torch.cat([scale, scale.new_zeros(pad)])
        #: int8 [N/64, K, 64]: panel p, input k, output 64 * p + j at [p, k, j]
        self.packed = (q.reshape(self.n_padded // BLOCK_N, BLOCK_N, k).transpose(1, 2)
                       .contiguous())
        self.scale = scale.contiguous()
        #: added after the product (the fused decode stack reads it too)
        self.bias = bias
        #: int64 {packed weights, scales, K blocking}: the fused decode stack's entry
        #: (``DL_INT8``)
        self.table = np.asarray([self.packed.data_ptr(), self.scale.data_ptr(), self.k_block],
                                dtype=np.int64)

    def nbytes(self) -> int:
        """Bytes of the weights as held (int8 values and scales)."""
        return self.packed.numel() + 4 * self.n_padded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32/bfloat16 [M, K] -> [M, N] of x's dtype.

        Raises:
            ValueError: x of another dtype, device or width.
            RuntimeError: the kernel's error code (3: out of memory).
        """
        if (x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu"
                or x.dtype not in _DTYPES):
            raise ValueError(f"int8-weight linear takes CPU float32/bfloat16 [M, {self.k}], "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        xf = x.float().contiguous()
        out = torch.empty(x.shape[0], self.n_padded, dtype=torch.float32)
        if x.shape[0]:
            self.quant.linear_int8w(xf.data_ptr(), self.packed.data_ptr(),
                                    self.scale.data_ptr(), out.data_ptr(), x.shape[0],
                                    self.n_padded, self.k, self.k_block)
        if self.n_padded != self.n:
            out = out[:, :self.n].contiguous()
        if x.dtype != torch.float32:
            out = out.to(x.dtype)
        if self.bias is not None:
            out += self.bias
        return out

    def weight(self) -> torch.Tensor:
        """The dequantized weight ``Wq * scale`` as float32 [N, K] (for tests and reference
        copies)."""
        q = self.packed.transpose(1, 2).reshape(self.n_padded, self.k)[:self.n]
        return q.float() * self.scale[:self.n, None]
