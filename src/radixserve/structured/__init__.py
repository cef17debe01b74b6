"""Structured outputs through xgrammar: compiling constraints (``compiler``, used by the server
and the engine core) and the engine's per-request matchers and token bitmasks (``runtime``).

A layer below ``core`` and ``entrypoints``: it imports only the leaf ``sampling_params`` (and
xgrammar, lazily).
"""

from radixserve.structured.compiler import GrammarCompiler, GrammarError

__all__ = ["GrammarCompiler", "GrammarError"]
