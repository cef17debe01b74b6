"""Compile-checking a ``Generate`` request's output constraint before it is submitted, so a bad
JSON schema, regex or grammar is ``INVALID_ARGUMENT`` naming the proto field and the engine
core never sees it (the HTTP server's ``ServingState.check_constraint`` does the same; the two
frontends are independent, so each holds its own compiler).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from radixserve.entrypoints.grpc_worker.translate import InvalidArgument
from radixserve.sampling_params import StructuredOutputsParams
from radixserve.structured.compiler import GrammarCompiler, GrammarError


class ConstraintChecker:
    """xgrammar's compiler over the worker's tokenizer, made at the first constrained request
    (a worker that never sees one never loads xgrammar). Compiled grammars stay in the
    compiler's LRU, and the engine core compiles the same spec again in its own process (a
    cache hit there for any constraint seen before).

    Args:
        tokenizer: the transformers tokenizer (xgrammar's ``TokenizerInfo`` is built from it).
        vocab_size: the model's vocabulary size (the logits width).
        eos_token_ids: the model's EOS ids (a grammar's end allows only these).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._args = (tokenizer, vocab_size, list(eos_token_ids))
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        """The compiler, made on first use (thread-safe: checks run in worker threads)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler

    async def check(self, spec: StructuredOutputsParams | None, field: str | None) -> None:
        """Compile ``spec`` in a worker thread (off the event loop); nothing when None.

        Raises:
            InvalidArgument: the constraint does not compile; ``field`` is the proto field
                (``sampling_params.json_schema``, ...) and the message xgrammar's reason.
        """
        if spec is None:
            return
        try:
            await asyncio.to_thread(lambda: self.compiler().compile(spec))
        except GrammarError as e:
            raise InvalidArgument(field or "sampling_params.constraint", str(e)) from None
