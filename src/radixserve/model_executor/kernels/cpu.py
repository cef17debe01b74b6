"""radixserve's CPU kernels (``csrc/cpu_kernels.c``): built once per machine with the system C
compiler, loaded with ctypes (which releases the GIL during each call).

* **Paged decode attention.** On CPU the torch path must first gather every decode's KV pages
  into a padded tensor (``index_select``) and then run SDPA's flash kernel, which is inefficient
  with one query token; together they read the context three times. The kernel reads each key
  and value row once, in place, and shares it across the query heads of a GQA group.
* **Fused residual add + RMSNorm** (vLLM's ``fused_add_rms_norm``): torch's CPU ``rms_norm`` is
  a chain of ~8 small ops, ~50 us per call at batch 1, 61 calls per SmolLM2 step; one call here.
* **GGUF-quantized linears** (``csrc/quant_kernels.c``, wrapped by ``quant.QuantKernels``, the
  ``quant`` attribute): weights read as the file's ggml blocks, integer dot products.

The shared object is cached under ``cache_dir("kernels")`` (``~/.cache/radixserve/kernels``
by default; ``$RADIXSERVE_CACHE_DIR`` or ``$XDG_CACHE_HOME`` move it), keyed by the source, the compiler flags and the CPU's
flags (it is built with ``-march=native``). No compiler, or a failed build, leaves the torch
path in use (``load()`` returns None and says why in the log).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from radixserve.cache_dir import cache_dir
from radixserve.model_executor.kernels.amx import AmxKernels
from radixserve.model_executor.kernels.quant import QuantKernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
#: every C source linked into the one shared object (the cache key covers them all)
SOURCES = (SOURCE, SOURCE.with_name("quant_kernels.c"), SOURCE.with_name("amx_kernels.c"))
CFLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=fast"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _check_attention_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              out: torch.Tensor) -> None:
    """The checks both paged attention kernels share: one dtype (float32 or bfloat16) for q,
    the caches and out; q [*, H, D] over caches [num_pages, page_size, Hkv, D] with H a
    multiple of Hkv. Raises ValueError naming what does not fit."""
    if (q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
            or out.dtype != q.dtype):
        raise ValueError(f"dtypes must all be float32 or bfloat16, got q {q.dtype}, "
                         f"k {k_cache.dtype}, v {v_cache.dtype}, out {out.dtype}")
    h, d = q.shape[1], q.shape[2]
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    if dk != d or v_cache.shape != k_cache.shape or h % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit KV {tuple(k_cache.shape)}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors' bytes overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def cpu_signature() -> str:
    """The CPU's model name and flags from /proc/cpuinfo ("unknown" where unreadable): the
    key of per-machine caches."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    keep = [ln for ln in lines if ln.startswith(("flags", "model name"))][:2]
    return "\n".join(keep)


def build(compiler: str | None = None, march: str = "native") -> Path:
    """Compile the kernel unless a matching build is cached; returns the ``.so`` path.

    Args:
        compiler: the C compiler (default: ``$CC``, then ``cc``, then ``gcc``).
        march: GCC's ``-march``: "native" for this CPU (the engine's), or an older target
            such as "haswell" (the AVX2 kind's code paths, for tests on an AVX-512 machine).

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its stderr is in the message).
    """
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    src = b"".join(p.read_bytes() for p in SOURCES)
    flags = [*CFLAGS, f"-march={march}"]
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode()
                         + cpu_signature().encode()).hexdigest()[:16]
    out = cache_dir("kernels") / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build to a temporary name and rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"],
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class CpuKernels:
    """The loaded kernel library. Use ``CpuKernels.load()``; it returns None when the library
    cannot be built here."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        #: the loaded build's file name (its hash covers the source, flags and CPU): part of
        #: the key of measurements that depend on the kernels' code
        self.build_id = Path(lib._name).name
        i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        fn = lib.rs_paged_decode_attention
        fn.argtypes = [c_int, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64,
                       i64, i64, i64, i64, c_float, c_int]
        fn.restype = c_int
        self._attn = fn
        fn = lib.rs_paged_prefill_attention
        fn.argtypes = [c_int, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, i64,
                       i64, i64, c_float, c_int]
        fn.restype = c_int
        self._prefill = fn
        fn = lib.rs_add_rms_norm
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, c_float, c_int]
        fn.restype = c_int
        self._norm = fn
        fn = lib.rs_add_rms_norm_bf16
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, c_float, c_int]
        fn.restype = c_int
        self._norm_bf16 = fn
        fn = lib.rs_rope
        fn.argtypes = [c_int, ptr, i64, i64, i64, i64, ptr, ptr, c_int]
        fn.restype = c_int
        self._rope = fn
        fn = lib.rs_silu_mul
        fn.argtypes = [c_int, ptr, ptr, i64, i64, c_int]
        fn.restype = c_int
        self._silu_mul = fn
        fn = lib.rs_argmax_rows
        fn.argtypes = [ptr, i64, i64, i64, ptr, c_int]
        fn.restype = c_int
        self._argmax = fn
        fn = lib.rs_store_kv
        fn.argtypes = [c_int, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64]
        fn.restype = c_int
        self._store_kv = fn
        self._linear = {}
        for dt, name in ((torch.bfloat16, "rs_linear_bf16_packed"),
                         (torch.float32, "rs_linear_f32_packed")):
            fn = getattr(lib, name)
            fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, c_int]
            fn.restype = c_int
            self._linear[dt] = fn
        fn = lib.rs_linear_f32_bf16w
        fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, c_int]
        fn.restype = c_int
        self._linear_bf16w = fn
        fn = lib.rs_decode_layers
        fn.argtypes = [c_int, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64,
                       i64, i64, i64, i64, i64, i64, c_float, c_float, c_int]
        fn.restype = c_int
        #: ``rs_decode_layers`` (``models/decode_stack.py`` checks and calls it)
        self.decode_layers = fn
        fn = lib.rs_stream_read
        fn.argtypes = [ptr, i64, c_int]
        fn.restype = ctypes.c_double
        self._stream_read = fn
        fn = lib.rs_evict_from_cache
        fn.argtypes = [ptr, i64, c_int]
        fn.restype = None
        self._evict = fn
        fn = lib.rs_has_f32_gemm
        fn.argtypes = []
        fn.restype = c_int
        #: the float32 linear kernel's build: "avx512", "avx2" (AVX2 + FMA) or None (not built)
        self.f32_gemm_isa: str | None = {2: "avx512", 1: "avx2"}.get(fn())
        fn = lib.rs_kernel_isa
        fn.argtypes = []
        fn.restype = c_int
        isa = fn()
        #: GGUF-quantized linears and embedding rows (``csrc/quant_kernels.c``)
        self.quant = QuantKernels(lib)
        #: radixserve's bfloat16 GEMM on AMX tiles (``csrc/amx_kernels.c``)
        self.amx = AmxKernels(lib)
        #: the bfloat16 attention path this build has, by the instructions the compiler found
        #: (``-march=native``): "avx512-bf16" (scores with ``vdpbf16ps``, P.V widened in
        #: registers), "avx512" (P.V in registers only) or "portable" (vector extensions)
        self.bf16_attention_isa = ("avx512-bf16" if isa & 1 else "avx512" if isa & 2
                                   else "portable")
        #: the build has AVX512-BF16's ``vdpbf16ps`` (the bf16 scores and the bf16 linear kernel)
        self.has_bf16_dot = bool(isa & 1)

    @classmethod
    def load(cls, march: str = "native") -> CpuKernels | None:
        """Build (or reuse the cached build) for ``march`` (``build``) and load; None, with a
        log line, on failure."""
        # torch's own libgomp must be loaded first so the kernel binds to the same runtime
        torch.get_num_threads()
        try:
            return cls(ctypes.CDLL(str(build(march=march))))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            log.warning("CPU attention kernel unavailable, using torch SDPA: %s", e)
            return None

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in _DTYPES

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, page_table: torch.Tensor,
                               seq_lens: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """Attention of one query token per sequence over its pages, written into ``out``.

        Args:
            q: [B, H, D] float32/bfloat16, last dim contiguous (other strides free).
            k_cache, v_cache: contiguous [num_pages, page_size, Hkv, D], q's dtype.
            page_table: int64 [B, >= ceil(max(seq_lens) / page_size)], rows contiguous; the
                row stride is free (0: every query reads one sequence's pages, as the queries
                of a prefill chunk do).
            seq_lens: contiguous int64 [B], keys per sequence (>= 1).
            out: contiguous [B, H, D], q's dtype.
            scale: softmax scale (usually D ** -0.5).

        Raises:
            ValueError: bad shapes, layouts or dtypes (checked here, not in C).
            RuntimeError: the kernel reported an error (2: a length outside [1, page_table
                columns * page_size]; 4: a page id outside the pool; 3: out of memory).
        """
        b, h, d = q.shape
        _, page_size, hkv, _ = k_cache.shape
        _check_attention_operands(q, k_cache, v_cache, out)
        if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()
                                    and out.is_contiguous() and page_table.stride(1) == 1
                                    and seq_lens.is_contiguous()):
            raise ValueError("k/v cache, out and seq_lens must be contiguous, page_table rows "
                             "too")
        if page_table.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("page_table and seq_lens must be int64")
        if tuple(out.shape) != (b, h, d) or page_table.shape[0] != b or seq_lens.shape != (b,):
            raise ValueError("out, page_table and seq_lens must have one row per sequence")
        rc = self._attn(_DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
                      k_cache.data_ptr(), v_cache.data_ptr(), page_table.data_ptr(),
                      page_table.stride(0), page_table.shape[1], k_cache.shape[0],
                      seq_lens.data_ptr(), out.data_ptr(), b, h, hkv, d,
                      page_size, scale, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"paged decode attention kernel failed with code {rc}")

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, pages: torch.Tensor, ctx: int,
                                out: torch.Tensor, scale: float) -> None:
        """Causal attention of one sequence's prefill chunk over its pages, into ``out``.

        The ``n = q.shape[0]`` queries sit at positions ``[ctx - n, ctx)``; row r sees keys
        ``[0, ctx - n + r]``. Each row is computed with exactly the arithmetic of
        ``paged_decode_attention`` for that context, so results do not depend on chunking.

        Args:
            q: [n, H, D] float32/bfloat16, last dim contiguous.
            k_cache, v_cache: contiguous [num_pages, page_size, Hkv, D], q's dtype.
            pages: contiguous int64 [>= ceil(ctx / page_size)], the sequence's page ids.
            ctx: keys of the sequence after this chunk (tokens), ``n <= ctx``.
            out: contiguous [n, H, D], q's dtype.
            scale: softmax scale.

        Raises:
            ValueError: bad shapes, layouts or dtypes.
            RuntimeError: the kernel reported an error (2: ctx outside [n, pages * page_size];
                4: a page id outside the pool; 3: out of memory).
        """
        n, h, d = q.shape
        _, page_size, hkv, _ = k_cache.shape
        _check_attention_operands(q, k_cache, v_cache, out)
        if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()
                                    and out.is_contiguous() and pages.is_contiguous()):
            raise ValueError("k/v cache, out and pages must be contiguous")
        if pages.dtype != torch.int64 or tuple(out.shape) != (n, h, d):
            raise ValueError("pages must be int64 and out [n, H, D]")
        rc = self._prefill(_DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
                           k_cache.data_ptr(), v_cache.data_ptr(), pages.data_ptr(),
                           pages.shape[0], k_cache.shape[0], ctx, n, out.data_ptr(), h, hkv, d,
                           page_size, scale, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"paged prefill attention kernel failed with code {rc}")

    def add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """``residual += x`` in place (skipped when x is None), then RMSNorm of the new residual.

        transformers' ``LlamaRMSNorm`` arithmetic: ``r * rsqrt(mean(r ** 2) + eps) * weight``
        in float32; in bfloat16 the residual sum, the normalized row and the product with the
        weight are each rounded to bfloat16 where torch's ops round them, with the mean in
        float32. The mean is summed in a different order than torch's, so results may differ
        from ``F.rms_norm`` in the last bit.

        Args:
            x: contiguous [M, N] in residual's dtype, or None.
            residual: contiguous float32 or bfloat16 [M, N], updated in place.
            weight: contiguous [N], residual's dtype.
            eps: added to the mean square.
            out: where to write the result (contiguous [M, N], residual's dtype), x itself
                included: a row of x is read whole before that row of out is written. None:
                a new tensor. A prefill chunk's layer writes its normed rows over the
                activations they came from, so one fewer [T, hidden] tensor is alive.
        Returns: ``out``, or a new [M, N] tensor in residual's dtype.

        Raises:
            ValueError: wrong dtype, shape or layout, or ``out`` overlapping ``residual``.
            RuntimeError: the kernel reported an error (its non-zero return code).
        """
        m, n = residual.shape
        dt = residual.dtype
        if (dt not in _DTYPES or weight.dtype != dt
                or (x is not None and (x.dtype != dt or x.shape != residual.shape
                                       or not x.is_contiguous()))
                or weight.shape != (n,) or not residual.is_contiguous()
                or not weight.is_contiguous()
                or (out is not None and (out.dtype != dt or out.shape != residual.shape
                                         or not out.is_contiguous()))):
            raise ValueError("add_rms_norm needs contiguous float32 or bfloat16 x/residual/out "
                             "[M, N] and weight [N], all of one dtype")
        if out is None:
            out = torch.empty_like(residual)
        elif out.numel() and residual.numel() and _overlap(out, residual):
            raise ValueError("add_rms_norm's out must not overlap residual")
        fn = self._norm if dt == torch.float32 else self._norm_bf16
        rc = fn(None if x is None else x.data_ptr(), residual.data_ptr(),
                weight.data_ptr(), out.data_ptr(), m, n, eps, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"fused add + RMSNorm kernel failed with code {rc}")
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE (the Hugging Face / GPT-NeoX layout) applied to ``x`` in place,
        with torch's rounding after every product and sum (``llama.apply_rope``'s values).

        Args:
            x: float32 or bfloat16 [T, heads, D], D even, heads and D contiguous (the token
                stride is free: Q and K may be a view of the fused QKV output).
            cos, sin: contiguous [T, D // 2] in x's dtype.
        Returns: x.

        Raises:
            ValueError: wrong dtype, shape or layout.
        """
        t, heads, d = x.shape
        if (x.dtype not in _DTYPES or cos.dtype != x.dtype or sin.dtype != x.dtype
                or d % 2 or cos.shape != (t, d // 2) or sin.shape != (t, d // 2)
                or x.stride(2) != 1 or x.stride(1) != d or not cos.is_contiguous()
                or not sin.is_contiguous()):
            raise ValueError("rope_ needs x [T, heads, D] (heads and D contiguous, D even) and "
                             "contiguous cos/sin [T, D // 2], all of one float32/bfloat16 dtype")
        rc = self._rope(_DTYPES[x.dtype], x.data_ptr(), t, heads, d, x.stride(0),
                        cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"RoPE kernel failed with code {rc}")
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation ``silu(gate) * up`` of the fused gate/up projection's output, in
        one pass; the SiLU is rounded to the activation dtype before the product, as torch's
        two ops round it. Its exponential is Cephes' (``exp_nonpos`` in the C source), so
        values may differ from torch's SiLU in the last bit of float32.

        Args:
            gate_up: contiguous float32 or bfloat16 [T, 2 * I] (gate, then up).
        Returns: a new [T, I] tensor in gate_up's dtype.

        Raises:
            ValueError: wrong dtype, shape or layout.
        """
        t, two_i = gate_up.shape
        if gate_up.dtype not in _DTYPES or two_i % 2 or not gate_up.is_contiguous():
            raise ValueError("silu_mul needs a contiguous float32/bfloat16 [T, 2 * I] tensor")
        out = torch.empty(t, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
        rc = self._silu_mul(_DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), t,
                            two_i // 2, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"SiLU-and-multiply kernel failed with code {rc}")
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy sampling's ``x.argmax(dim=-1)`` with torch's semantics (the first index of
        the maximum; the first NaN's index in a row that has one), rows across threads.

        Args:
            x: float32 [S, V], last dim contiguous (the row stride is free).
        Returns: int64 [S].

        Raises:
            ValueError: wrong dtype, shape or layout.
        """
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
            raise ValueError("argmax_rows needs float32 [S, V > 0] with contiguous rows")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                     torch.get_num_threads())
        return out

    def has_linear_kernel(self, dtype: torch.dtype) -> bool:
        """Whether ``linear_packed`` is built for ``dtype`` on this machine (bf16: AVX512-BF16;
        float32: AVX2 + FMA or AVX-512)."""
        return self.has_bf16_dot if dtype == torch.bfloat16 else (
            dtype == torch.float32 and self.f32_gemm_isa is not None)

    def linear_packed(self, x: torch.Tensor, packed_ptr: int, out: torch.Tensor,
                      k_block: int) -> None:
        """``out = x @ W.T`` for a weight W [N, K] in oneDNN's packed layout (bf16
        [N/64][K/2][64][2], float32 [N/64][K][64]; ``layers.packed_kernel``), each row summed
        as oneDNN's GEMM sums it, with K blocks of ``k_block``: a register-tiled GEMM (bf16: a
        GEMV for one row).

        Args:
            x: contiguous bfloat16 or float32 [M, K].
            packed_ptr: address of the packed buffer (``torch.ops.mkldnn.data_ptr``), at
                least ``N * K`` values; only its first ``N / 64`` blocks are read.
            out: contiguous [M, N] of x's dtype, N a multiple of 64: written.
            k_block: > 0 (bf16: even).

        Raises:
            ValueError: wrong dtype, shape or layout.
            RuntimeError: the build lacks the instructions (code 5) or bad sizes (1).
        """
        if (x.dtype not in self._linear or out.dtype != x.dtype or x.dim() != 2
                or out.dim() != 2 or x.shape[0] != out.shape[0]
                or not x.is_contiguous() or not out.is_contiguous()):
            raise ValueError("linear_packed needs contiguous bfloat16/float32 x [M, K], "
                             "out [M, N] of one dtype")
        self.linear_packed_unchecked(x.dtype, x.data_ptr(), packed_ptr, out.data_ptr(),
                                     x.shape[0], out.shape[1], x.shape[1], k_block)

    def linear_packed_unchecked(self, dtype: torch.dtype, x_ptr: int, packed_ptr: int,
                                out_ptr: int, m: int, n: int, k: int, k_block: int) -> None:
        """``linear_packed`` on raw addresses, for a caller that has checked the tensors
        once (a lone decode makes 120 of these calls per SmolLM2 step: ~5 us of checks each).

        Raises:
            RuntimeError: the kernel's error code (see ``linear_packed``).
        """
        rc = self._linear[dtype](x_ptr, packed_ptr, out_ptr, m, n, k, k_block,
                                 torch.get_num_threads())
        if rc:
            raise RuntimeError(f"{dtype} linear kernel failed with code {rc}")

    def stream_read(self, x: torch.Tensor) -> float:
        """Read every value of a contiguous float32 tensor once, front to back, on torch's
        thread count (the read bandwidth probe of ``bench.bandwidth``); returns their sum.

        Raises:
            ValueError: x not a contiguous float32 CPU tensor.
        """
        if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("stream_read needs a contiguous float32 CPU tensor")
        return self._stream_read(x.data_ptr(), x.numel(), torch.get_num_threads())

    def evict_from_cache(self, address: int, nbytes: int) -> None:
        """Write back and drop from every cache level the ``nbytes`` bytes at ``address`` (a
        live CPU buffer: a tensor's ``data_ptr()`` and at most its size), so the next read
        comes from memory (``path_choice``'s timings of a model larger than the last-level
        cache)."""
        self._evict(address, nbytes, torch.get_num_threads())

    def linear_f32_bf16w(self, x_ptr: int, w_ptr: int, out_ptr: int, m: int, n: int, k: int,
                         k_block: int) -> None:
        """``out = x @ W.T`` in float32 for bfloat16 weights packed ``[N/64][K][64]``
        (``layers.bf16_weight_linear``), each output one chain of float32 FMAs restarted every
        ``k_block`` inputs: the float32 kernel's bits over the widened weight. On raw
        addresses: x float32 [M, K], out float32 [M, N] (N % 64 == 0), both contiguous; the
        caller checks them.

        Raises:
            RuntimeError: the kernel's error code (1 bad sizes, 3 out of memory, 5 a build
                without AVX2 + FMA).
        """
        rc = self._linear_bf16w(x_ptr, w_ptr, out_ptr, m, n, k, k_block,
                                torch.get_num_threads())
        if rc:
            raise RuntimeError(f"bf16-weight linear kernel failed with code {rc}")

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write the step's K/V rows into their slots (``flat_cache.index_copy_(0, slots, k)``
        for both caches, in one call).

        Args:
            k, v: [T, Hkv, D] float32/bfloat16, heads and D contiguous (the token stride is
                free: views of the fused QKV output).
            k_cache, v_cache: contiguous [num_pages, page_size, Hkv, D], k's dtype.
            slot_mapping: contiguous int64 [T], flat slot (page * page_size + offset) per
                token.

        Raises:
            ValueError: wrong dtype, shape or layout.
            RuntimeError: a slot outside the pool (nothing was written).
        """
        t, hkv, d = k.shape
        row = hkv * d
        if (k.dtype not in _DTYPES or v.dtype != k.dtype or k_cache.dtype != k.dtype
                or v_cache.dtype != k.dtype or v.shape != k.shape
                or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape
                or k.stride(2) != 1 or k.stride(1) != d or v.stride(2) != 1 or v.stride(1) != d
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())
                or slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,)
                or not slot_mapping.is_contiguous()):
            raise ValueError("store_kv needs k/v [T, Hkv, D] (heads and D contiguous), "
                             "contiguous caches [N, page, Hkv, D] of their dtype and int64 "
                             "slots [T]")
        rc = self._store_kv(_DTYPES[k.dtype], k.data_ptr(), k.stride(0), v.data_ptr(),
                            v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                            slot_mapping.data_ptr(), t, row,
                            k_cache.shape[0] * k_cache.shape[1])
        if rc:
            raise RuntimeError(f"store_kv: a slot outside the pool of "
                               f"{k_cache.shape[0] * k_cache.shape[1]} (code {rc})")
