"""Start-up shared by the two frontends (the HTTP server and the gRPC worker): the engine core
and the model's tokenizer, loaded at the same time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from radixserve.engine_types import EngineInfo
from radixserve.frontend.async_client import AsyncEngineClient


async def start_engine_with_tokenizer(client: AsyncEngineClient) -> tuple[EngineInfo, Any]:
    """Start ``client``'s engine core and load the tokenizer while it loads the model (seconds
    each on two cores).

    The early load (``loader.tokenizer_if_ready``) only runs where the model's folder is
    known without converting anything, as the class its ``tokenizer_config.json`` names; the
    engine's folder and tokenizer class (``EngineInfo.tokenizer_class``, the class AutoTokenizer
    picks) decide, so a different folder or class, or a failed early load, means the tokenizer
    loads again as the engine says. Neither load imports torch where the class is transformers'
    own.

    Returns:
        the engine's ``EngineInfo`` and the Hugging Face tokenizer of ``info.folder``.

    Raises:
        whatever ``client.start`` raises (the engine failed to start), and ``ValueError`` from
        ``loader.load_tokenizer`` (no loadable tokenizer in the engine's folder).
    """
    from radixserve.model_executor.loader import (
        load_tokenizer,
        tokenizer_class_path,
        tokenizer_if_ready,
    )

    warm = asyncio.ensure_future(asyncio.to_thread(tokenizer_if_ready, client.config.model))
    info = await client.start()
    early = await warm
    if (early is not None and early[0] == Path(info.folder) and info.tokenizer_class
            and tokenizer_class_path(type(early[1])) == info.tokenizer_class):
        return info, early[1]
    return info, await asyncio.to_thread(load_tokenizer, info.folder, info.tokenizer_class)
