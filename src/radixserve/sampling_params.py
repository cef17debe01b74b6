"""Per-request sampling knobs, shared by the offline API, the HTTP server and the engine core.

A ``msgspec.Struct`` so it travels over the engine socket as MessagePack without pickle.
Field names and meanings follow vLLM's ``SamplingParams`` so users can switch engines.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

#: Largest number of top logprobs a request may ask for (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20
#: Most completions per prompt (OpenAI's limit).
MAX_N = 128
#: Seeds ``torch.Generator.manual_seed`` accepts (and MessagePack can carry): [-2**63, 2**64-1].
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
#: Token ids and token counts travel and are stored as int32.
MAX_INT32 = 2**31 - 1
#: Most logprob entries (prompt positions x vocabulary) one ``prompt_logprobs=-1`` request
#: may ask for: each costs about 100 bytes in the engine's rows and in a JSON response, so this
#: bounds one near 200 MB (42 positions of a 49,152-token vocabulary). vLLM bounds the same with
#: ``--max-logprobs`` (20 by default, which refuses -1 altogether).
MAX_WHOLE_VOCAB_PROMPT_LOGPROBS = 2**21
#: ``logit_bias`` values are clamped by OpenAI's API to this range.
MAX_LOGIT_BIAS = 100.0


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on the generated text, compiled by xgrammar (vLLM's
    ``StructuredOutputsParams``, the same field names).

    Exactly one of the constraint fields is set.

    Attributes:
        json: a JSON schema, as JSON text (a dict is encoded on construction, keys in their
            given order: xgrammar generates properties in schema order).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's GBNF dialect, rule ``root``).
        json_object: any JSON object (OpenAI's ``response_format: json_object``).
        disable_any_whitespace: JSON without free whitespace (xgrammar's compact separators
            ``", "`` and ``": "``); the default allows any whitespace between tokens, as JSON
            does.
        disable_additional_properties: objects of the schema take no properties beyond those
            listed (``additionalProperties: false`` everywhere; xgrammar's strict mode).

    Raises:
        ValueError: none or several constraints, an empty choice list, or a JSON schema that
            is not JSON (the message starts with ``structured_outputs``). Whether the schema,
            regex or grammar compiles is checked by ``radixserve.structured``.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            try:
                self.json = _json_text(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json is not JSON-encodable: {e}") from None
        kinds = [k for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar or json_object (got {', '.join(kinds) or 'none'})")
        if self.choice is not None and not (
                self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def cache_key(self) -> bytes:
        """A key that is equal exactly for constraints that compile to the same grammar."""
        return msgspec.msgpack.encode(self)


def _json_text(obj: object) -> str:
    import json

    return json.dumps(obj, ensure_ascii=False)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick each next token and when to stop.

    Attributes:
        n: completions per prompt, in [1, 128].
        temperature: softmax temperature (>= 0); 0 means greedy.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) disables; at most 2**31-1.
        min_p: drop tokens whose probability is below ``min_p`` times the top one, in [0, 1].
        seed: per-request generator seed in [-2**63, 2**64-1] (what ``torch.Generator``
            accepts); the same seed gives the same tokens alone or batched.
        presence_penalty / frequency_penalty: OpenAI-style additive penalties over generated
            tokens, in [-2, 2].
        repetition_penalty: multiplicative penalty (CTRL paper, as in HF ``generate``) over prompt
            and generated tokens, > 0; 1 disables.
        max_tokens: generated tokens at most, in [1, 2**31-1]; ``None`` means all the room
            ``max_model_len`` leaves after the prompt (the engine core fills it in).
        min_tokens: EOS and ``stop_token_ids`` are suppressed until this many tokens exist
            (at most ``max_tokens``).
        stop: strings that end the output (checked on detokenized text, trimmed from it).
        stop_token_ids: token ids in [0, 2**31-1] that end the output (kept in ``token_ids``).
        ignore_eos: keep generating after EOS.
        logprobs: return the chosen token's logprob and the top ``logprobs`` (0..20) per step.
        prompt_logprobs: per prompt position after the first, the logprob of the prompt's
            token there and the top ``prompt_logprobs`` (0..20) alternatives (vLLM's field; -1:
            every token of the vocabulary, as in vLLM, resolved by the engine core, which
            refuses it beyond ``MAX_WHOLE_VOCAB_PROMPT_LOGPROBS`` entries). Such
            a request takes no radix-cache prefix hit: every prompt position is recomputed, as
            vLLM does, since a cached prefix keeps KV, not logits.
        logit_bias: token id -> value in [-100, 100] added to that token's logit before
            sampling (OpenAI's ``logit_bias``); ids in [0, 2**31-1] here, below the vocabulary
            size in the engine core.
        structured_outputs: a grammar constraint on the output (``StructuredOutputsParams``).
        skip_special_tokens: drop special tokens when detokenizing.
        include_stop_str_in_output: keep the matched stop string in the text.
        extra_args: vLLM's per-request extension dict; radixserve reads only
            ``{"kv_transfer_params": {...}}`` (prefill/decode disaggregation offline, as vLLM's
            ``LLM.generate``); any other key is an error.

    Every int is bounded so that the struct always encodes on the engine socket (MessagePack
    ints are at most 64 bits) and fits the engine's int32/int64 arrays.

    Raises:
        ValueError: from ``__post_init__``: the message starts with ``field=value`` and names the
            allowed range (the server turns it into a 400 whose ``param`` is the field).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(1 <= self.n <= MAX_N, "n", self.n, f"must be in [1, {MAX_N}]")
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0, "temperature",
               self.temperature, "must be finite and >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(-1 <= self.top_k <= MAX_INT32, "top_k", self.top_k,
               f"must be -1 (disabled) or in [0, {MAX_INT32}]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None:
            _check(MIN_SEED <= self.seed <= MAX_SEED, "seed", self.seed,
                   "must be in [-2**63, 2**64-1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               self.frequency_penalty, "must be in [-2, 2]")
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", self.repetition_penalty, "must be finite and > 0")
        if self.max_tokens is not None:
            _check(1 <= self.max_tokens <= MAX_INT32, "max_tokens", self.max_tokens,
                   f"must be in [1, {MAX_INT32}]")
        _check(0 <= self.min_tokens <= MAX_INT32, "min_tokens", self.min_tokens,
               f"must be in [0, {MAX_INT32}]")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs,
                   f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            _check(-1 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                   self.prompt_logprobs,
                   f"must be in [0, {MAX_LOGPROBS}], or -1 for the whole vocabulary")
        if self.stop_token_ids is not None:
            for t in self.stop_token_ids:
                _check(0 <= t <= MAX_INT32, "stop_token_ids", t,
                       f"must be token ids in [0, {MAX_INT32}]")
        if self.stop is not None:
            for s in self.stop:
                _check(isinstance(s, str) and len(s) > 0, "stop", s, "must be non-empty strings")
        if self.logit_bias is not None:
            for t, v in self.logit_bias.items():
                _check(0 <= t <= MAX_INT32, "logit_bias", t,
                       f"has a token id outside [0, {MAX_INT32}]")
                _check(math.isfinite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
                       "logit_bias", v, "has a value outside [-100, 100]")
        if self.extra_args is not None:
            _check(isinstance(self.extra_args, dict)
                   and set(self.extra_args) <= {"kv_transfer_params"}, "extra_args",
                   self.extra_args, "must be a dict whose only key is kv_transfer_params")

    def children(self) -> list[SamplingParams]:
        """The ``n`` single-sample requests of these params: ``n=1`` each and, when seeded,
        seed ``seed + i`` (wrapped into the seed range), so samples differ but stay
        reproducible. ``[self]`` when ``n`` is 1."""
        if self.n == 1:
            return [self]
        out = []
        for i in range(self.n):
            seed = self.seed
            if seed is not None:
                seed += i
                if seed > MAX_SEED:
                    seed -= 2**64  # same generator state modulo 2**64, still encodable
            out.append(msgspec.structs.replace(self, n=1, seed=seed))
        return out

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} {rule}")
