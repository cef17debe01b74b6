"""Pydantic models of the OpenAI API request bodies (chat completions, completions, tokenize)
and of ``GET /v1/models``; responses are built as plain dicts by the formatters.

Field names, defaults and shapes follow the OpenAI API, with vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``structured_outputs``, ...).
Nothing is silently ignored: an unknown top-level field (other than the bookkeeping ones in
``NO_OP_FIELDS``) or a known one this server cannot honour is listed by
``unsupported_fields`` and refused with a 400 naming it; a null value is "not set" and always
accepted. Ranges are checked once, by
``SamplingParams`` (``to_sampling_params`` raises its ``ValueError``); pydantic checks types and
shapes (a ``ValidationError`` becomes a 400 through ``errors.error_from_validation``), and
that every string is valid Unicode text (``lone_surrogate_at``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.sampling_params import (
    MAX_INT32,
    MAX_SEED,
    MIN_SEED,
    SamplingParams,
    StructuredOutputsParams,
)


def unsupported_error(bad: list[str], why: str = "") -> OpenAIError:
    """The 400 for request fields this server cannot honour: names them all (``param`` the
    first), with ``why`` where a field has a reason of its own."""
    many = len(bad) > 1
    return OpenAIError(
        f"Unsupported parameter{'s' if many else ''}: {', '.join(bad)}. "
        + (f"{why}. " if why else "")
        + f"radixserve does not implement {'them' if many else 'it'} (or not with this value) "
        "and does not ignore fields that would change the output.", param=bad[0],
        code="unsupported_parameter")

class OpenAIBaseModel(BaseModel):
    """Base of every nested API model: unknown fields are ignored (message parts, tool
    definitions and the like carry fields other servers add)."""

    model_config = ConfigDict(extra="ignore")


#: Top-level request fields accepted although they change nothing in the output (OpenAI's
#: bookkeeping and routing hints).
NO_OP_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                          "prompt_cache_key", "stream_interval"})


# -- text --------------------------------------------------------------------------------------


def lone_surrogate_at(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first string in ``value`` (a parsed JSON value: its strings, dict keys included,
    at any depth) that is not valid Unicode text, as ``(dotted path, the offending code
    point as U+XXXX)``; None when every string is valid.

    JSON's ``\\ud800`` escape decodes to a lone UTF-16 surrogate, which is no character: no
    tokenizer takes it and no UTF-8 encoder (the engine link, a response body, a log line)
    writes it. The walk is iterative: a value nested as deep as ``json.loads`` allows does not
    exhaust the stack here.
    """
    todo: list[tuple[str, Any]] = [(path, value)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    return where, f"U+{ord(v[e.start]):04X}"
            continue
        prefix = f"{where}." if where else ""
        if isinstance(v, dict):
            items = [(f"{prefix}{k}", x) for k, v2 in v.items() for x in (k, v2)
                     if isinstance(x, (str, dict, list))]
        elif isinstance(v, list):  # numbers (token ids) are skipped without a path
            items = [(f"{prefix}{i}", x) for i, x in enumerate(v)
                     if isinstance(x, (str, dict, list))]
        else:
            continue
        todo.extend(reversed(items))  # first item on top: the first bad string is reported
    return None


def _valid_text(value: Any, info: ValidationInfo) -> Any:
    """A field validator (``mode="before"``): every string in the field's value, at any
    depth, must be valid Unicode text (``lone_surrogate_at``); a 400 naming the field."""
    bad = lone_surrogate_at(value, info.field_name or "")
    if bad is not None:
        where, char = bad
        raise ValueError(f"{where.encode('utf-8', 'backslashreplace').decode()} is not valid "
                         f"Unicode text: it holds a lone surrogate ({char}; JSON's \\u escapes "
                         "of a surrogate must come in high-low pairs)")
    return value


# -- requests ----------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts;
    ``continuous_usage_stats`` (vLLM) adds the running counts to every chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class TextContentPart(OpenAIBaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    """A tool call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str = ""


class ToolCall(OpenAIBaseModel):
    """A tool call of an assistant message in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    """A request message; ``content`` is a string or a list of text parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined with no separator)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it: role and text content, plus ``tool_calls``
        with their arguments parsed to objects (what Hugging Face templates expect; vLLM does
        the same), ``tool_call_id`` and ``name`` where given."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args: Any = json.loads(c.function.arguments or "{}")
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDefinition(OpenAIBaseModel):
    """``tools[i].function``: name, description and JSON schema of the parameters."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: the schema (under ``schema``), its name, ``strict``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError("response_format.json_schema.schema is required when type is "
                             "'json_schema'")
        return self


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of ``json`` (a schema), ``regex``,
    ``choice``, ``grammar`` (EBNF) or ``json_object``, with its options."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completion requests.

    An explicit JSON ``null`` for a field with a default means "use the default" (OpenAI accepts
    ``"temperature": null``). ``stream_options`` without ``stream=true`` is a validation error
    (a 400 naming ``stream_options``). Fields this server does not know are kept
    (``model_extra``) so that ``check_supported`` can refuse them: nothing is silently ignored.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    #: vLLM's field: names the request like ``X-Request-Id`` (the header wins)
    request_id: str | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # pydantic's range check, so the 400 reads as vLLM's (``greater_than_equal`` /
    # ``less_than_equal``); the bounds are what ``torch.Generator`` takes
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names of ``structured_outputs``
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = None
    # accepted only with the values that change nothing (see ``_RESTRICTED``)
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    # SGLang's names, which its router and vllm-router write into every request they forward:
    # ``no_stop_trim`` is SGLang's ``include_stop_str_in_output`` (honoured as that);
    # hidden states are not returned, so only ``false`` is accepted
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    #: field -> the values that keep the output unchanged (anything else is refused)
    _RESTRICTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "spaces_between_special_tokens": (True,), "use_beam_search": (False,),
        "length_penalty": (1.0,), "priority": (0,), "truncate_prompt_tokens": (None,),
        "return_hidden_states": (False,),
    }
    #: prefill/decode disaggregation (vLLM's field; checked by the engine core)
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            return {
                k: v
                for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required()
                or fields[k].default is None
            }
        return data

    #: every string of a request must be valid Unicode text (the tokenizer and the engine link
    #: take nothing else): a lone surrogate is a 400 naming the field, never a 5xx downstream
    _text = field_validator("*", mode="before")(_valid_text)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None,
                                    info: ValidationInfo) -> StreamOptions | None:
        # OpenAI and vLLM refuse it too (a 400 naming ``stream_options``) rather than silently
        # dropping a usage chunk the client asked for; ``stream`` is declared first, so it is
        # in ``info.data`` when it was valid
        if v is not None and info.data.get("stream") is not True:
            raise ValueError("stream_options can only be set when stream=true")
        return v

    def check(self) -> None:
        """Refuse what this server cannot honour (``unsupported_fields``).

        Raises:
            OpenAIError: 400 naming the first such field (all of them in the message).
        """
        bad = self.unsupported_fields()
        if bad:
            raise unsupported_error(bad)
        if self.prompt_logprobs is not None and self.stream:
            # vLLM refuses it too: prompt logprobs are not streamed
            raise OpenAIError("prompt_logprobs are not available with stream=true",
                              param="prompt_logprobs")

    def unsupported_fields(self) -> list[str]:
        """Fields set to something this server cannot honour: unknown fields (not null, not in
        ``NO_OP_FIELDS``) and known ones outside their supported values. Empty when the request
        can be served as asked."""
        bad = [k for k, v in (self.model_extra or {}).items()
               if v is not None and k not in NO_OP_FIELDS]
        for name, ok in self._RESTRICTED.items():
            if getattr(self, name) not in ok:
                bad.append(name)
        so = self.structured_outputs
        if so is not None:
            bad += [f"structured_outputs.{k}" for k in ("whitespace_pattern", "structural_tag")
                    if getattr(so, k) is not None]
        return bad

    def stop_list(self) -> list[str] | None:
        """``stop`` as a list (a single string becomes a one-element list)."""
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """True when every streamed chunk carries the usage so far (vLLM's
        ``continuous_usage_stats``, which like vLLM needs ``include_usage`` too)."""
        return bool(self.include_usage and self.stream_options
                    and self.stream_options.continuous_usage_stats)

    def logit_bias_ids(self, vocab_size: int | None = None) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids.

        Args:
            vocab_size: the model's vocabulary size; keys must be below it (None: checked
                against 2**31-1 here, against the vocabulary by the engine core).

        Raises:
            ValueError: keys that are not token ids (not integers, negative, or not in the
                vocabulary), all of them named in one message that starts with
                ``logit_bias=`` (vLLM lists every out-of-vocabulary id the same way).
        """
        if not self.logit_bias:
            return None
        out = {}
        bad: list[str] = []
        hi = MAX_INT32 + 1 if vocab_size is None else vocab_size
        for k, v in self.logit_bias.items():
            try:
                t = int(k)
            except ValueError:
                bad.append(k)
                continue
            if not 0 <= t < hi:
                bad.append(k)
            out[t] = float(v)
        if bad:
            raise ValueError(f"logit_bias={bad!r}: these keys are not token ids of the "
                             f"vocabulary [0, {hi}) (keys are token ids, integers as strings)")
        return out

    def _sampling_params(
        self, max_tokens: int | None, default_max_tokens: int | None, logprobs: int | None,
        structured: StructuredOutputsParams | None = None, prompt_logprobs: int | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        # the model's recommended values (``--generation-config``) for the fields this body
        # leaves unset; an explicit null counts as unset (``_null_means_default`` dropped it)
        set_here = self.model_fields_set

        def pick(name: str) -> Any:
            if defaults and name in defaults and name not in set_here:
                return defaults[name]
            return getattr(self, name)

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty"),
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop_list(),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            logit_bias=self.logit_bias_ids(),
            structured_outputs=structured,
        )


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # Reasoning-content options (SGLang: separate_reasoning, stream_reasoning; vLLM:
    # include_reasoning; routers forward them with their defaults). Like SGLang and vLLM without
    # ``--reasoning-parser``, this server has no reasoning parser, so the whole completion is
    # ``content`` whatever their value: they select nothing here.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    # OpenAI's legacy function calling and features of other models: refused unless null
    # (they are unknown fields otherwise, also refused, but named the same way)
    modalities: list[str] | None = None

    _RESTRICTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest._RESTRICTED, "modalities": (None, ["text"])}

    def check(self) -> None:
        """``_SamplingRequest.check``, plus tools and chat-template options that contradict
        each other (vLLM's rules).

        Raises:
            OpenAIError: 400 naming the field.
        """
        super().check()
        if self.tools is not None and not self.tools:
            raise OpenAIError("tools must not be an empty list (omit it instead)", param="tools")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and self.tools and choice.function.name not in {
                t.function.name for t in self.tools}:
            raise OpenAIError(f"tool_choice names function {choice.function.name!r}, which is "
                              "not among tools", param="tool_choice")
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError("continue_final_message and add_generation_prompt cannot both be "
                              "true (set add_generation_prompt=false to continue the last "
                              "message)", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise OpenAIError("continue_final_message needs the last message to be the "
                              "assistant's", param="continue_final_message")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def to_sampling_params(self, default_max_tokens: int | None,
                           structured: StructuredOutputsParams | None = None,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Engine sampling params; ``default_max_tokens`` applies when no max is given (None:
        all the room the prompt leaves). ``structured`` is the output constraint
        (``constraints.structured_outputs_for``); ``defaults`` the model's sampling defaults
        (``frontend.generation_config``) for the fields the body leaves unset.

        ``max_completion_tokens`` wins over the deprecated ``max_tokens``; ``logprobs=true``
        asks for ``top_logprobs`` alternatives (0 when unset).

        Raises:
            ValueError: a value out of range (the message starts with ``field=value``).
        """
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs!r} requires logprobs=true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, default_max_tokens, logprobs, structured,
                                     self.prompt_logprobs, defaults)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` body."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = False
    # accepted only where they change nothing: no suffix, best_of equal to n
    suffix: str | None = None
    best_of: int | None = None

    _RESTRICTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest._RESTRICTED, "suffix": (None, "")}

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        return bad

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each item is text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, default_max_tokens: int | None,
                           structured: StructuredOutputsParams | None = None,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Engine sampling params; ``default_max_tokens`` applies when ``max_tokens`` is None,
        ``defaults`` (the model's sampling defaults) to the fields the body leaves unset.

        ``echo`` with ``logprobs`` asks for the prompt's logprobs too (``prompt_logprobs``
        defaults to ``logprobs``, as vLLM does); ``max_tokens`` 0 with ``echo`` runs one token
        that the response leaves out (``echo_only``).

        Raises:
            ValueError: a value out of range (the message starts with ``field=value``).
        """
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._sampling_params(max_tokens, default_max_tokens, self.logprobs,
                                     structured, prompt_logprobs, defaults)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the answer is the prompt alone (with its
        logprobs)."""
        return self.echo and self.max_tokens == 0


# -- models, tokenize ----------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radixserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    """``GET /v1/models`` body."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` (text) or ``messages`` (chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    _text = field_validator("*", mode="before")(_valid_text)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
