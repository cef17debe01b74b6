"""The model's tokenizer files as the zip ``GetTokenizer`` streams (so smg needs no
``--model-path``).

The engine names an HF folder for every model it loads (a GGUF file's config and tokenizer are
converted once into one under the cache dir, tokenizer.json, tokenizer_config.json with the chat template and special
tokens, and chat_template.jinja included), so the bundle is that folder's tokenizer files.
The file list follows smg's ``smg_grpc_servicer.tokenizer_bundle`` (what its Rust tokenizer
loader looks for); chunks are 64 KiB, the SHA-256 of the whole archive rides on the last one.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

#: Bytes per ``GetTokenizerChunk`` (smg's servicers use the same size).
CHUNK_SIZE = 64 * 1024

#: Files of a model folder that smg's tokenizer loader reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json",
                   "generation_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json")
TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja")


def build_bundle(folder: str | Path) -> tuple[bytes, str]:
    """The zip of ``folder``'s tokenizer files and its SHA-256 hex digest.

    Raises:
        FileNotFoundError: the folder has no tokenizer file.
    """
    folder = Path(folder)
    names = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    for pattern in TOKENIZER_GLOBS:
        names += sorted(p.name for p in folder.glob(pattern) if p.is_file() and p.name not in names)
    if "tokenizer.json" not in names and "tokenizer.model" not in names:
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {folder}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            zf.write(folder / name, name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str, chunk_size: int = CHUNK_SIZE
           ) -> Iterator[tuple[bytes, str]]:
    """``(piece, sha256 or "")`` pairs: the archive in order, the digest on the last piece."""
    for off in range(0, len(data), chunk_size):
        end = min(off + chunk_size, len(data))
        yield data[off:end], sha256 if end == len(data) else ""
