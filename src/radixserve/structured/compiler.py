"""Compiling output constraints (JSON schema, regex, choice, EBNF grammar) with xgrammar, for
one tokenizer, with a keyed LRU of compiled grammars.

The server compiles every constraint once before submitting (a bad one is a 400 naming the
problem, the engine never sees it); the engine core compiles again in its own process (a cache
hit for any schema seen before) to build the per-request matchers. xgrammar itself is
imported only when a constraint is first used: a server that never sees one never loads it.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import Any

from radixserve.sampling_params import StructuredOutputsParams

#: Compiled grammars kept per compiler (a JSON schema's grammar is ~100 KB for a 49k vocabulary).
DEFAULT_CACHE_ENTRIES = 256


class GrammarError(ValueError):
    """A constraint that does not compile: an invalid JSON schema, regex or EBNF grammar.

    The message names the constraint kind and carries xgrammar's own explanation.
    """


def _clean(err: Exception) -> str:
    """xgrammar's error text without its C++ source location prefix."""
    text = str(err).strip()
    # "[07:28:23] /project/cpp/regex_converter.cc:83: Regex parsing error ..."
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        if rest and rest.split(":", 1)[0].endswith((".cc", ".h")):
            rest = rest.split(": ", 1)[-1]
            return rest.strip()
    return text


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar (xgrammar's dialect) whose language is exactly ``choices``: one
    alternative per string, JSON string escapes (xgrammar reads ``\\"``, ``\\\\``, ``\\n``)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """xgrammar's ``GrammarCompiler`` for one tokenizer, behind a keyed LRU.

    Args:
        tokenizer: a transformers tokenizer (its vocabulary becomes xgrammar's
            ``TokenizerInfo``).
        vocab_size: the model's vocabulary size, i.e. the logits width (may differ from the
            tokenizer's length: xgrammar pads or truncates the token mask to it).
        stop_token_ids: ids that end generation (the model's EOS ids); a grammar's last token
            mask allows only these.
        max_entries: compiled grammars kept (least recently used evicted).

    Thread-safe: the server compiles in worker threads.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        import xgrammar as xgr

        stop = sorted(set(stop_token_ids)) or None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.vocab_size = vocab_size
        # our own LRU holds the compiled results; xgrammar's cache would keep a second copy
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False,
                                        max_threads=max(1, min(4, os.cpu_count() or 1)))
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (from the cache when seen before).

        Raises:
            GrammarError: the schema, regex or grammar does not compile (xgrammar's reason).
        """
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._xgr
        kind = spec.kind
        any_ws = not spec.disable_any_whitespace
        try:
            if kind == "json":
                assert spec.json is not None
                try:
                    json.loads(spec.json)
                except ValueError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
                # strict mode (xgrammar's default, as vLLM uses it): no properties or items
                # beyond those the schema lists
                return c.compile_json_schema(spec.json, any_whitespace=any_ws, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws,
                                             strict_mode=False)
            if kind == "regex":
                assert spec.regex is not None
                return c.compile_regex(spec.regex)
            if kind == "choice":
                assert spec.choice is not None
                return c.compile_grammar(choice_grammar(spec.choice))
            assert spec.grammar is not None
            return c.compile_grammar(spec.grammar)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "json_object": "JSON object grammar",
                    "regex": "regex", "choice": "choice list", "grammar": "EBNF grammar"}[kind]
            raise GrammarError(f"invalid {what}: {_clean(e)}") from None
