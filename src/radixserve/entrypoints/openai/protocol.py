"""Pydantic models of the OpenAI API request bodies (chat completions, completions, tokenize)
and of ``GET /v1/models``; responses are built as plain dicts by the formatters.

Field names, defaults and shapes follow the OpenAI API, with vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ...). Unknown fields are ignored,
so clients written for other servers work unchanged. Ranges are checked once, by
``SamplingParams`` (``to_sampling_params`` raises its ``ValueError``); pydantic checks types and
shapes (a ``ValidationError`` becomes a 400 through ``errors.error_from_validation``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from radixserve.sampling_params import SamplingParams


class OpenAIBaseModel(BaseModel):
    """Base of every API model: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


# -- requests ----------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    include_usage: bool | None = False


class TextContentPart(OpenAIBaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    """A request message; ``content`` is a string or a list of text parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined with no separator)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and text completion requests.

    An explicit JSON ``null`` for a field with a default means "use the default" (OpenAI accepts
    ``"temperature": null``). ``stream_options`` without ``stream=true`` is a validation error
    (a 400 naming ``stream_options``).
    """

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
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

    def stop_list(self) -> list[str] | None:
        """``stop`` as a list (a single string becomes a one-element list)."""
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(
        self, max_tokens: int | None, default_max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop_list(),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Engine sampling params; ``default_max_tokens`` applies when no max is given (None:
        all the room the prompt leaves).

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
        return self._sampling_params(max_tokens, default_max_tokens, logprobs)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` body. ``suffix`` is accepted and ignored."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each item is text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Engine sampling params; ``default_max_tokens`` applies when ``max_tokens`` is None.

        Raises:
            ValueError: a value out of range (the message starts with ``field=value``).
        """
        return self._sampling_params(self.max_tokens, default_max_tokens, self.logprobs)


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

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
