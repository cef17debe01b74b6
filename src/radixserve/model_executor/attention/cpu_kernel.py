"""The CPU paged decode-attention kernel (``csrc/paged_attention_cpu.c``): built once per
machine with the system C compiler, loaded with ctypes.

Why C and not torch ops: on CPU the torch path must first gather every decode's KV pages into a
padded tensor (``index_select``) and then run SDPA's flash kernel, which is inefficient with one
query token; together they read the context three times. The kernel reads each key and value
row once, in place, and shares it across the query heads of a GQA group.

The shared object is cached under ``$RADIXSERVE_CACHE_DIR`` (default
``~/.cache/radixserve``) ``/kernels/``, keyed by the source, the compiler flags and the CPU's
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
          "-ffp-contract=fast"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    keep = [ln for ln in lines if ln.startswith(("flags", "model name"))][:2]
    return "\n".join(keep)


def cache_dir() -> Path:
    root = os.environ.get("RADIXSERVE_CACHE_DIR") or Path.home() / ".cache" / "radixserve"
    return Path(root) / "kernels"


def build(compiler: str | None = None) -> Path:
    """Compile the kernel unless a matching build is cached; returns the ``.so`` path.

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its stderr is in the message).
    """
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *CFLAGS]).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    out = cache_dir() / f"paged_attention_cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build to a temporary name and rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"],
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class PagedDecodeKernel:
    """Callable wrapper around ``rs_paged_decode_attention``.

    Use ``PagedDecodeKernel.load()``; it returns None when the kernel cannot be built here.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.rs_paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64,
                       i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    @classmethod
    def load(cls) -> PagedDecodeKernel | None:
        """Build (or reuse the cached build) and load; None, with a log line, on failure."""
        # torch's own libgomp must be loaded first so the kernel binds to the same runtime
        torch.get_num_threads()
        try:
            return cls(ctypes.CDLL(str(build())))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            log.warning("CPU attention kernel unavailable, using torch SDPA: %s", e)
            return None

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in _DTYPES

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 page_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 scale: float) -> None:
        """Attention of one query token per sequence over its pages, written into ``out``.

        Args:
            q: [B, H, D] float32/bfloat16, last dim contiguous (other strides free).
            k_cache, v_cache: contiguous [num_pages, page_size, Hkv, D], q's dtype.
            page_table: contiguous int64 [B, >= ceil(max(seq_lens) / page_size)].
            seq_lens: contiguous int64 [B], keys per sequence (>= 1).
            out: contiguous [B, H, D], q's dtype.
            scale: softmax scale (usually D ** -0.5).

        Raises:
            ValueError: bad shapes, layouts or dtypes (checked here, not in C).
            RuntimeError: the kernel reported an error (2: a length outside [1, page_table
                columns * page_size]; 4: a page id outside the pool; 3: out of memory).
        """
        b, h, d = q.shape
        _, page_size, hkv, dk = k_cache.shape
        if (q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
                or out.dtype != q.dtype):
            raise ValueError(f"dtypes must all be float32 or bfloat16, got q {q.dtype}, "
                             f"k {k_cache.dtype}, v {v_cache.dtype}, out {out.dtype}")
        if dk != d or v_cache.shape != k_cache.shape or h % hkv:
            raise ValueError(f"q {tuple(q.shape)} does not fit KV {tuple(k_cache.shape)}")
        if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()
                                    and out.is_contiguous() and page_table.is_contiguous()
                                    and seq_lens.is_contiguous()):
            raise ValueError("k/v cache, out, page_table and seq_lens must be contiguous")
        if page_table.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("page_table and seq_lens must be int64")
        if tuple(out.shape) != (b, h, d) or page_table.shape[0] != b or seq_lens.shape != (b,):
            raise ValueError("out, page_table and seq_lens must have one row per sequence")
        rc = self._fn(_DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
                      k_cache.data_ptr(), v_cache.data_ptr(), page_table.data_ptr(),
                      page_table.stride(0), page_table.shape[1], k_cache.shape[0],
                      seq_lens.data_ptr(), out.data_ptr(), b, h, hkv, d,
                      page_size, scale, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"paged decode attention kernel failed with code {rc}")
