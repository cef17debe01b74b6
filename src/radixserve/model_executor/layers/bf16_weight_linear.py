"""A float32 linear whose weights stay in bfloat16, the dtype a checkpoint ships them in.

Why: on a CPU without native bf16 arithmetic (the AVX2 kind) a model is served in float32, and
widening a bf16 checkpoint's weights to float32 at load doubles both its memory (a 7B model's
15 GB become 30 GB) and the bytes every decode step reads, which is what bounds a decode step
once the weights leave the cache. Widening is exact, so the weights are held as they were
shipped and widened in registers as the float32 GEMM loads them (``rs_linear_f32_bf16w``): the
same float32 FMAs, in the same order, as the float32 kernel over the widened weight, hence the
same bits, for half the bytes.

The kernel runs every row count (a prefill chunk too: a thread widens each 16- or 64-output
panel once into its own scratch and runs its row tiles over it), so a row's result never
depends on the batch. Its K blocking is oneDNN's for the shape where ``find_k_block`` finds one
(then each row gets exactly the bits of the float32 oneDNN path), else one block of K.

Under bfloat16 activations (``act_dtype``) the same GEMM serves a bf16 model on a CPU whose bf16
dot products (``vdpbf16ps``) are slower than its float32 FMAs: the rows are widened (exact), the
float32 sums rounded back to bf16 once per output, and a bias added after the rounding as torch
adds a bf16 bias. Which arithmetic a bf16 model gets is measured per machine
(``path_choice.choose_bf16_gemm``).
"""

from __future__ import annotations

import torch

from radixserve.model_executor.kernels.cpu import CpuKernels

#: outputs per packed panel (the float32 kernel's [N/64][K][64] layout)
BLOCK_N = 64


class Bf16WeightLinear:
    """``x [M, K] -> x @ W.T (+ bias) [M, N]`` with W held in bfloat16 and summed in float32.

    Args:
        kernels: the loaded C kernels, with the float32 GEMM built (``f32_gemm_isa``).
        weight: bfloat16 [N, K], N a multiple of 64; copied into the packed layout
            ``[N/64, K, 64]`` (the caller may free it).
        bias: [N] in ``act_dtype``, added after the product (as torch adds it), or None.
        k_block: the K blocking of each output's sum (> 0).
        act_dtype: the activations' dtype, float32 or bfloat16 (widened to float32 for the
            GEMM, its sums rounded back).

    Raises:
        ValueError: a weight that is not bf16 2-D with N % 64 == 0, a bias of the wrong shape
            or dtype, another ``act_dtype``, or a build without the float32 GEMM.
    """

    def __init__(self, kernels: CpuKernels, weight: torch.Tensor, bias: torch.Tensor | None,
                 k_block: int, act_dtype: torch.dtype = torch.float32) -> None:
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] % BLOCK_N:
            raise ValueError(f"bf16-weight linear needs a bfloat16 [N, K] weight with N a "
                             f"multiple of {BLOCK_N}, got {weight.dtype} {tuple(weight.shape)}")
        if kernels.f32_gemm_isa is None:
            raise ValueError("bf16-weight linear needs the float32 GEMM (AVX2 + FMA)")
        if act_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"bf16-weight linear runs float32 or bfloat16 activations, not "
                             f"{act_dtype}")
        n, k = weight.shape
        if bias is not None and (bias.dtype != act_dtype or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias must be {act_dtype} [{n}], got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        if k_block <= 0:
            raise ValueError(f"k_block must be > 0, got {k_block}")
        self.kernels, self.n, self.k, self.k_block = kernels, n, k, k_block
        self.act_dtype = act_dtype
        #: bfloat16 [N/64, K, 64]: panel p, input k, output 64 * p + j at [p, k, j]
        self.packed = (weight.detach().reshape(n // BLOCK_N, BLOCK_N, k).transpose(1, 2)
                       .contiguous())
        self.ptr = self.packed.data_ptr()
        #: added after the product (the fused decode stack reads it too)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (M >= 1) in ``act_dtype`` -> [M, N] in ``act_dtype``.

        Raises:
            ValueError: x of another dtype or width.
            RuntimeError: the kernel's error code (3: out of memory).
        """
        if x.dtype != self.act_dtype or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"bf16-weight linear takes {self.act_dtype} [M, {self.k}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        x = x.contiguous() if x.dtype == torch.float32 else x.float()
        out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        if x.shape[0]:
            self.kernels.linear_f32_bf16w(x.data_ptr(), self.ptr, out.data_ptr(), x.shape[0],
                                          self.n, self.k, self.k_block)
        if self.act_dtype != torch.float32:
            out = out.to(self.act_dtype)
        if self.bias is not None:
            out += self.bias
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 [T], each in [0, N)) of W in ``act_dtype`` [T, K]: a tied
        embedding looked up in the LM head's packed weights, so no second copy is held."""
        return self.packed[ids // BLOCK_N, :, ids % BLOCK_N].to(self.act_dtype)

    def weight(self) -> torch.Tensor:
        """W as bfloat16 [N, K] (a new tensor: for tests and reference copies)."""
        return self.packed.transpose(1, 2).reshape(self.n, self.k)
