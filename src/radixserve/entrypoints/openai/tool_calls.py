"""Tool calls in chat completions: how tools reach the prompt, and how the generated text
becomes OpenAI ``tool_calls`` (whole, or as streamed deltas).

Three output forms, by ``tool_choice``:

* ``"auto"``: the model may call tools in the Hermes format, ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3 and Hermes templates); text around the calls
  is the message content. A chat template that renders ``tools`` in another format is not
  parsed ("auto" is refused for it; "required" and named calls still work).
* ``"required"``: the output is constrained (``constraints.required_tools_schema``) to a JSON
  array of ``{"name", "parameters"}``; each item is a call.
* a named function: the output is constrained to that function's arguments schema; it is the
  call's ``arguments``.

A template that ignores ``tools`` (SmolLM2's, for one) gets the tool list and the Hermes
instructions in its system message instead, and tool calls and results in the conversation are
written in the same format (``<tool_call>`` in the assistant's text, ``<tool_response>`` in a
user turn), so any chat model can be offered tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    NamedToolChoice,
)
from radixserve.frontend.tokenizer import FrontendTokenizer

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def new_tool_call_id() -> str:
    """A fresh tool call id (``call_`` and 24 hex digits, OpenAI's look)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry; ``arguments`` is JSON text."""
    return {"id": call_id or new_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


# -- the prompt -------------------------------------------------------------------------------------


def tools_system_block(tools: list[ChatCompletionToolsParam]) -> str:
    """The Hermes-format tool instructions for a template that does not render ``tools``:
    each function's signature as one JSON line inside ``<tools>``, and how to call one."""
    lines = "\n".join(_dump({"type": "function", "function": t.function.model_dump(
        exclude_none=True)}) for t in tools)
    return ("# Tools\n\nYou can call functions to help answer the user. Their signatures, one "
            f"JSON object per line:\n<tools>\n{lines}\n</tools>\n\nTo call a function, write a "
            "JSON object with its name and arguments between <tool_call> and </tool_call>:\n"
            f"{TOOL_CALL_START}\n" '{"name": "<function name>", "arguments": {<arguments as '
            'JSON>}}\n' f"{TOOL_CALL_END}")


def _hermes_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation turns with tool calls and results written as Hermes text (for templates
    that render neither)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = m.get("content") or ""
            for c in calls:
                f = c["function"]
                text += (("\n" if text else "") + f"{TOOL_CALL_START}\n"
                         + _dump({"name": f["name"], "arguments": f["arguments"]})
                         + f"\n{TOOL_CALL_END}")
            m["content"] = text
        if m["role"] == "tool":
            m = {"role": "user",
                 "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    return out


@dataclass
class ToolPrompt:
    """How a request's tools reach the prompt.

    Attributes:
        messages: the messages to render (Hermes-rewritten when the template ignores tools).
        template_tools: ``tools`` for the template, or None.
        native: the template renders ``tools`` itself.
        hermes: calls in the output are parsed in the Hermes format (``tool_choice`` "auto").
    """

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    native: bool
    hermes: bool


def _renders_tools(tok: FrontendTokenizer, tools: list[dict[str, Any]],
                   kwargs: dict[str, Any]) -> bool:
    """Whether the chat template renders ``tools`` (a probe conversation differs with them)."""
    probe = [{"role": "user", "content": "x"}]
    try:
        with_tools = tok.chat_prompt(probe, True, None, tools=tools, **kwargs)
        without = tok.chat_prompt(probe, True, None, **kwargs)
    except ValueError:
        return False
    return with_tools != without


def tool_prompt(req: ChatCompletionRequest, tok: FrontendTokenizer,
                messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> ToolPrompt:
    """Decide how the tools of ``req`` are offered to the model.

    Raises:
        OpenAIError: 400 for ``tool_choice`` "auto" with a template that renders tools in a
            format other than Hermes' (it could not be parsed).
    """
    choice = req.effective_tool_choice
    if not req.tools:
        return ToolPrompt(messages, None, False, False)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    native = _renders_tools(tok, tools, template_kwargs)
    template = template_kwargs.get("chat_template") or getattr(tok.hf, "chat_template", "") or ""
    if native:
        if choice == "auto" and TOOL_CALL_START not in template:
            raise OpenAIError(
                "tool_choice 'auto' needs a chat template with Hermes-style <tool_call> tool "
                "calls; this model's template uses another format. Use tool_choice 'required' "
                "or a named function (constrained, any format).", param="tool_choice")
        return ToolPrompt(messages, tools, True, choice == "auto")
    if choice == "none":
        return ToolPrompt(_hermes_history(messages), None, False, False)
    block = tools_system_block(req.tools)
    msgs = _hermes_history(messages)
    if msgs and msgs[0]["role"] in ("system", "developer"):
        msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{block}"}
    else:
        msgs.insert(0, {"role": "system", "content": block})
    return ToolPrompt(msgs, None, False, choice == "auto")


# -- parsing the output -----------------------------------------------------------------------------


def _hermes_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return tool_call(obj["name"], args if isinstance(args, str) else _dump(args))


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split Hermes output into content and tool calls.

    Returns:
        (the text outside the calls, or None when it is only whitespace; the calls). A
        ``<tool_call>`` block that is not a JSON object with a ``name`` stays in the content;
        an unterminated last block (cut by ``max_tokens``) is parsed when it is complete JSON.
    """
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(TOOL_CALL_END, start)
        body_end = len(text) if end < 0 else end
        call = _hermes_call(text[start + len(TOOL_CALL_START):body_end])
        if call is None:
            content.append(text[pos:body_end if end < 0 else end + len(TOOL_CALL_END)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        if end < 0:
            break
        pos = end + len(TOOL_CALL_END)
    joined = "".join(content)
    return (joined if joined.strip() else None), calls


def required_items(text: str, pos: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The complete items of a ``tool_choice: "required"`` output (a JSON array of ``{"name",
    "parameters"}``, possibly cut short by ``max_tokens``) from character ``pos`` on, and the
    position after the last one. Each item is a call dict (``tool_call``); an item that is
    not an object naming a function is skipped (the grammar does not produce one)."""
    calls = []
    dec = json.JSONDecoder()
    while True:
        i = pos
        while i < len(text) and text[i] in " \t\r\n,[":
            i += 1
        if i >= len(text) or text[i] == "]":
            return calls, i
        try:
            item, end = dec.raw_decode(text, i)
        except ValueError:
            return calls, pos
        pos = end
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append(tool_call(item["name"], _dump(item.get("parameters", {}))))


def parse_required(text: str) -> list[dict[str, Any]] | None:
    """The calls of a complete ``tool_choice: "required"`` output, or None when the text is
    not a whole JSON array of ``{"name", "parameters"}``."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        calls.append(tool_call(it["name"], _dump(it.get("parameters", {}))))
    return calls


@dataclass
class ToolOutput:
    """How one choice's text is read: ``mode`` "auto" (Hermes), "required" or "named".

    ``parallel`` false (``parallel_tool_calls: false``) keeps only the first Hermes call of an
    "auto" output ("required" is constrained to one item already)."""

    mode: str
    name: str | None = None
    parallel: bool = True

    @classmethod
    def for_request(cls, req: ChatCompletionRequest, prompt: ToolPrompt) -> ToolOutput | None:
        """None when the output is plain text (no tools, or ``tool_choice`` "none")."""
        choice = req.effective_tool_choice
        if not req.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return cls("named", choice.function.name)
        if choice == "required":
            return cls("required")
        return cls("auto", parallel=req.parallel_tool_calls) if prompt.hermes else None

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """(content, tool_calls, finish_reason) of a finished choice. A named call that did not
        complete (cut by ``max_tokens``) leaves the text as content, unparsed; a "required"
        array cut short keeps its complete calls (the ones a stream has already sent) with
        finish_reason "length", like Hermes calls."""
        if self.mode == "named":
            if finish_reason == "stop":
                assert self.name is not None
                return None, [tool_call(self.name, text)], finish_reason
            return text, [], finish_reason
        if self.mode == "required":
            if finish_reason == "stop":
                calls = parse_required(text)
                if calls:
                    return None, calls, "tool_calls"
                return text, [], finish_reason
            calls = required_items(text)[0]
            return (None, calls, finish_reason) if calls else (text, [], finish_reason)
        content, calls = parse_hermes(text)
        if not self.parallel:
            calls = calls[:1]
        if calls:
            return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason
        return text, [], finish_reason

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)


@dataclass
class ToolStreamer:
    """Turns one choice's text deltas into chat ``delta`` dicts with content and
    ``tool_calls`` deltas (OpenAI's streamed shape: the first delta of a call carries its
    ``index``, ``id``, ``type`` and name, later ones more ``arguments`` text).

    A named call streams its arguments as they are generated; "required" and Hermes calls are
    sent whole when each one is complete (the text in between is content, held back while it
    could be the start of ``<tool_call>``).
    """

    out: ToolOutput
    buf: str = ""
    pos: int = 0
    calls: int = 0
    started: bool = False

    def _call_delta(self, call: dict[str, Any]) -> dict[str, Any] | None:
        if self.calls and not self.out.parallel:
            return None  # parallel_tool_calls false: the first call only
        d = {"tool_calls": [{"index": self.calls, **call}]}
        self.calls += 1
        return d

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Deltas for new text; ``final`` once the choice finished (flushes what was held)."""
        mode = self.out.mode
        if mode == "named":
            out = []
            if not self.started:
                self.started = True
                out.append({"tool_calls": [{"index": 0, "id": new_tool_call_id(),
                                            "type": "function",
                                            "function": {"name": self.out.name,
                                                         "arguments": ""}}]})
                self.calls = 1
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        self.buf += text
        if mode == "required":
            return self._feed_array(final)
        return self._feed_hermes(final)

    def _feed_array(self, final: bool) -> list[dict[str, Any]]:
        # complete items of the array, each sent once the json module decodes it
        calls, self.pos = required_items(self.buf, self.pos)
        out = [d for d in map(self._call_delta, calls) if d is not None]
        if final and not self.calls and self.buf.strip():
            out.append({"content": self.buf})  # not an array of calls after all (cut short)
        return out

    def _feed_hermes(self, final: bool) -> list[dict[str, Any]]:
        out = []
        buf = self.buf
        while True:
            start = buf.find(TOOL_CALL_START, self.pos)
            if start < 0:
                # content, except a tail that may still become "<tool_call>"
                keep = 0 if final else _partial_suffix(buf, TOOL_CALL_START, self.pos)
                text = buf[self.pos:len(buf) - keep]
                if text:
                    out.append({"content": text})
                self.pos = len(buf) - keep
                break
            if start > self.pos:
                out.append({"content": buf[self.pos:start]})
                self.pos = start
            end = buf.find(TOOL_CALL_END, start)
            if end < 0:
                if final:
                    body = buf[start + len(TOOL_CALL_START):]
                    call = _hermes_call(body)
                    d = self._call_delta(call) if call else {"content": buf[start:]}
                    if d is not None:
                        out.append(d)
                    self.pos = len(buf)
                break
            call = _hermes_call(buf[start + len(TOOL_CALL_START):end])
            stop = end + len(TOOL_CALL_END)
            d = self._call_delta(call) if call else {"content": buf[start:stop]}
            if d is not None:
                out.append(d)
            self.pos = stop
        return out


def _partial_suffix(text: str, marker: str, lo: int) -> int:
    """Length of the longest suffix of ``text[lo:]`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text) - lo), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
