"""The ``POST /v1/responses`` body (OpenAI's Responses API) and its translation into the chat
request the chat path already serves.

A Responses request is a chat request in other words: ``input`` (a string, or messages with
``input_text`` / ``output_text`` parts, ``function_call`` and ``function_call_output`` items)
becomes the chat ``messages``, ``instructions`` a system message first, ``max_output_tokens``
``max_completion_tokens``, function ``tools`` and ``tool_choice`` the chat ones, ``text.format``
the ``response_format``. Every field is validated here, under its Responses name, so a bad
value is a 400 naming it; ``to_chat_request`` then builds a ``ChatCompletionRequest`` that the
chat path's templating, tool prompts, constraints and sampling params take as they are.

Nothing is silently ignored (as in ``protocol``): an unknown field, and the Responses features
radixserve does not implement (stored responses: ``store``, ``previous_response_id``,
``background``; ``reasoning``, ``include``, ``truncation: "auto"``, ...), are a 400 naming them
unless null (or the value that changes nothing).
"""

from __future__ import annotations

import math
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
from radixserve.entrypoints.openai.protocol import (
    NO_OP_FIELDS,
    ChatCompletionRequest,
    OpenAIBaseModel,
    _valid_text,
    unsupported_error,
)


def _finite_json(value: Any, info: ValidationInfo) -> Any:
    """A field validator (``mode="before"``) for fields the response object repeats: no
    NaN or Infinity at any depth (Python's JSON parser reads them, but no JSON writer may
    write them back); a 400 naming the field."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{info.field_name} holds {v}, which is not a JSON number")
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return value


class InputContentPart(OpenAIBaseModel):
    """One text part of an input message: ``input_text`` (user, system, developer) or
    ``output_text`` (an assistant turn given back, as the Responses API returns it)."""

    type: Literal["input_text", "output_text"]
    text: str


def _text_parts(value: Any) -> Any:
    """A string content is one ``input_text`` part."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class InputItem(OpenAIBaseModel):
    """One item of ``input``: a message (``type`` "message", or no ``type`` with a ``role``),
    a ``function_call`` the model made earlier, or a ``function_call_output`` (its result).
    ``id`` and ``status`` of items given back from an earlier response are ignored: they do
    not reach the prompt in any server."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: list[InputContentPart] | None = None

    _parts = field_validator("content", "output", mode="before")(_text_parts)

    #: the fields each item type needs
    _NEEDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
        "function_call_output": ("call_id", "output")}

    @model_validator(mode="after")
    def _complete(self) -> InputItem:
        missing = [f for f in self._NEEDS[self.type] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {' and '.join(missing)}")
        return self

    def text(self) -> str:
        """The content (or a call's output) as one string, parts joined without a
        separator (as chat joins its text parts)."""
        parts = self.content if self.type == "message" else self.output
        return "".join(p.text for p in parts or [])


class FunctionTool(OpenAIBaseModel):
    """One entry of ``tools``: the Responses API's flat function definition. Only function
    tools exist here (built-in tools such as ``web_search`` are OpenAI's services)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        """The chat ``tools`` entry."""
        fn = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": fn}


class FunctionToolChoice(OpenAIBaseModel):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``schema``,
    ``name``, ``description`` and ``strict`` at the same level (the Responses layout)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text.format.schema is required when type is 'json_schema'")
        return self

    def to_chat(self) -> dict[str, Any]:
        """The chat ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "description": self.description,
                "schema": self.json_schema, "strict": self.strict}
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def echo(self) -> dict[str, Any]:
        """As the response object repeats it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(OpenAIBaseModel):
    """``text``: the output's ``format``; ``verbosity`` other than "medium" (the default) is
    refused (``ResponsesRequest.unsupported_fields``)."""

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesStreamOptions(OpenAIBaseModel):
    """``stream_options``: radixserve adds no obfuscation padding to its events, so only
    ``include_obfuscation: false`` (or null) is accepted."""

    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` body.

    Null means "not set" for every field. Sampling fields of vLLM's Responses extension
    (``top_k``, ``min_p``, ``seed``, ``stop``, ``repetition_penalty``, ...) mean what they mean
    in chat. Fields kept in ``model_extra`` are unknown and refused (``check``).
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # bookkeeping the response object repeats (changes no output)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    # vLLM's extensions, passed on to the chat request under the same names
    request_id: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Responses features radixserve does not implement: accepted only with the values that
    # change nothing (``_RESTRICTED``); responses are never stored, so nothing can refer to one
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    priority: int | None = None

    #: field -> the values that keep the output unchanged (anything else is refused)
    _RESTRICTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "store": (None, False), "background": (None, False), "previous_response_id": (None,),
        "conversation": (None,), "prompt": (None,), "reasoning": (None,),
        "include": (None, []), "truncation": (None, "disabled"), "top_logprobs": (None, 0),
        "max_tool_calls": (None,), "priority": (None, 0),
    }
    #: why a refused field cannot be served, where more than "not implemented" helps
    _WHY: ClassVar[dict[str, str]] = {
        "store": "store: radixserve keeps no responses (send false or leave it out)",
        "background": "background: a background response is fetched later, and radixserve "
                      "keeps no responses",
        "previous_response_id": "previous_response_id: radixserve keeps no responses; send "
                                "the whole conversation in input",
        "conversation": "conversation: radixserve keeps no conversations; send the whole "
                        "conversation in input",
    }

    #: every string must be valid Unicode text (see ``protocol.lone_surrogate_at``)
    _text = field_validator("*", mode="before")(_valid_text)
    #: what the response object repeats must be writable as JSON
    _finite = field_validator("tools", "text", "metadata", mode="before")(_finite_json)

    @field_validator("input", mode="before")
    @classmethod
    def _string_input(cls, value: Any) -> Any:
        # a string input is one user message
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: ResponsesStreamOptions | None,
                                    info: ValidationInfo) -> ResponsesStreamOptions | None:
        # as chat refuses it (``stream`` is declared first, so it is in ``info.data``)
        if v is not None and info.data.get("stream") is not True:
            raise ValueError("stream_options can only be set when stream=true")
        return v

    def unsupported_fields(self) -> list[str]:
        """Fields set to something this server cannot honour: unknown fields (not null, not in
        ``NO_OP_FIELDS`` other than ``store``) and known ones outside their supported values."""
        bad = [k for k, v in (self.model_extra or {}).items()
               if v is not None and k not in NO_OP_FIELDS]
        bad += [name for name, ok in self._RESTRICTED.items() if getattr(self, name) not in ok]
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            bad.append("text.verbosity")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            bad.append("stream_options.include_obfuscation")
        return bad

    def check(self) -> None:
        """Refuse what this server cannot honour, and tool choices that contradict the tools.

        Raises:
            OpenAIError: 400 naming the first such field (all of them in the message).
        """
        bad = self.unsupported_fields()
        if bad:
            raise unsupported_error(bad, "; ".join(self._WHY[b] for b in bad if b in self._WHY))
        if self.tools is not None and not self.tools:
            self.tools = None  # OpenAI's clients send an empty list for "no tools"
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, FunctionToolChoice) and self.tools and choice.name not in {
                t.name for t in self.tools}:
            raise OpenAIError(f"tool_choice names function {choice.name!r}, which is not "
                              "among tools", param="tool_choice")
        if self.input[0].type == "function_call_output":
            raise OpenAIError("a function_call_output item must follow its function_call",
                              param="input.0")

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """``tool_choice`` as the response object repeats it ("auto" when unset, OpenAI's
        default; without tools it calls nothing)."""
        choice = self.tool_choice
        if choice is None:
            return "auto"
        return choice if isinstance(choice, str) else choice.model_dump()

    def messages(self) -> list[dict[str, Any]]:
        """The chat ``messages``: ``instructions`` as a system message first, then the input
        items; a ``function_call`` joins the assistant message right before it (text and
        calls of one turn) or makes its own, a ``function_call_output`` is a ``tool``
        message."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        for item in self.input:
            if item.type == "message":
                out.append({"role": item.role, "content": item.text()})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": item.text()})
        return out

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means (every field was validated here already).

        Raises:
            OpenAIError: 400 from the chat request's own checks (``ChatCompletionRequest
                .check``), which name the same fields.
        """
        body: dict[str, Any] = {"messages": self.messages()}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [t.to_chat() for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.to_chat()
        for name in ("parallel_tool_calls", "temperature", "top_p", "top_k", "min_p", "seed",
                     "stop", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "logit_bias", "ignore_eos", "skip_special_tokens",
                     "include_stop_str_in_output", "stream"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        req = ChatCompletionRequest.model_validate(body)
        req.check()
        return req
