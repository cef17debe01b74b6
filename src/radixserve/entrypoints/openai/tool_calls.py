"""Tool calls in chat completions: how tools reach the prompt, and how the generated text
becomes OpenAI ``tool_calls`` (whole, or as streamed deltas).

Three output forms, by ``tool_choice``:

* ``"auto"``: the model may call tools in its family's format, read by the parser
  ``--tool-call-parser`` names (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``:
  ``ToolCallParser``; vLLM's names and formats); text around the calls is the message content.
  Without the flag, Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (Qwen2.5/Qwen3 and Hermes templates), and a chat template that renders ``tools`` in another
  format is not parsed ("auto" is refused for it; "required" and named calls still work).
  With ``--tool-call-parser`` but without ``--enable-auto-tool-choice``, "auto" is refused,
  as vLLM does.
* ``"required"``: the output is constrained (``constraints.required_tools_schema``) to a JSON
  array of ``{"name", "parameters"}``; each item is a call.
* a named function: the output is constrained to that function's arguments schema; it is the
  call's ``arguments``.

A template that ignores ``tools`` (SmolLM2's, for one) gets the tool list and the parser's
instructions in its system message instead, and tool calls and results in the conversation are
written in the same format (Hermes: ``<tool_call>`` in the assistant's text,
``<tool_response>`` in a user turn), so any chat model can be offered tools.
"""

from __future__ import annotations

import ast
import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

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


def tools_system_block(tools: list[ChatCompletionToolsParam],
                       parser: ToolCallParser | None = None) -> str:
    """The tool instructions for a template that does not render ``tools``: each function's
    signature as one JSON line inside ``<tools>``, and how to call one in ``parser``'s format
    (None: Hermes)."""
    return (parser or HermesParser()).instructions(tools)


def _text_history(messages: list[dict[str, Any]],
                  parser: ToolCallParser) -> list[dict[str, Any]]:
    """Conversation turns with tool calls and results written as text in ``parser``'s format
    (for templates that render neither)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = m.get("content") or ""
            m["content"] = text + ("\n" if text else "") + parser.render_calls(calls)
        if m["role"] == "tool":
            m = {"role": "user", "content": parser.render_result(m.get("content") or "")}
        m.pop("tool_call_id", None)
        out.append(m)
    return out


@dataclass
class ToolPrompt:
    """How a request's tools reach the prompt.

    Attributes:
        messages: the messages to render (rewritten in the parser's format when the template
            ignores tools).
        template_tools: ``tools`` for the template, or None.
        native: the template renders ``tools`` itself.
        hermes: calls in the output are parsed (``tool_choice`` "auto"), by ``parser``
            (named for the Hermes format, radixserve's default).
        parser: the format "auto" calls are read in.
    """

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    native: bool
    hermes: bool
    parser: ToolCallParser = field(default_factory=lambda: HermesParser())


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


#: vLLM's words for "auto" on a server with a parser but without ``--enable-auto-tool-choice``.
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")


def tool_prompt(req: ChatCompletionRequest, tok: FrontendTokenizer,
                messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                parser_name: str | None = None,
                auto_tool_choice: bool = False) -> ToolPrompt:
    """Decide how the tools of ``req`` are offered to the model.

    Args:
        parser_name: the server's ``--tool-call-parser`` (None: Hermes, with "auto" allowed
            where the template writes Hermes calls or ignores tools).
        auto_tool_choice: the server's ``--enable-auto-tool-choice``.

    Raises:
        OpenAIError: 400 naming ``tool_choice`` for "auto" on a server with a parser but
            without ``--enable-auto-tool-choice``, or (no parser named) with a template that
            renders tools in a format other than Hermes' (it could not be parsed).
    """
    choice = req.effective_tool_choice
    if not req.tools:
        return ToolPrompt(messages, None, False, False)
    parser = get_tool_call_parser(parser_name)
    if choice == "auto" and parser_name is not None and not auto_tool_choice:
        raise OpenAIError(AUTO_NEEDS_FLAGS, param="tool_choice")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    native = _renders_tools(tok, tools, template_kwargs)
    template = template_kwargs.get("chat_template") or getattr(tok.hf, "chat_template", "") or ""
    if native:
        if choice == "auto" and parser_name is None and TOOL_CALL_START not in template:
            raise OpenAIError(
                "tool_choice 'auto' needs a chat template with Hermes-style <tool_call> tool "
                "calls; this model's template uses another format. Use tool_choice 'required' "
                "or a named function (constrained, any format), or start the server with "
                "--enable-auto-tool-choice --tool-call-parser NAME for this model's format.",
                param="tool_choice")
        return ToolPrompt(messages, tools, True, choice == "auto", parser)
    if choice == "none":
        return ToolPrompt(_text_history(messages, parser), None, False, False, parser)
    block = tools_system_block(req.tools, parser)
    msgs = _text_history(messages, parser)
    if msgs and msgs[0]["role"] in ("system", "developer"):
        msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{block}"}
    else:
        msgs.insert(0, {"role": "system", "content": block})
    return ToolPrompt(msgs, None, False, choice == "auto", parser)


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


# -- per-model formats of "auto" tool calls (vLLM's --tool-call-parser names) -------------------------

#: What a parser's stream yields: ("content", text) or ("call", a ``tool_call`` dict).
Event = tuple[str, Any]

_ALNUM = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    """A Mistral tool call id: 9 letters and digits (Mistral's templates refuse other ids)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class ToolCallParser:
    """One model family's tool-call format, read from the generated text whole (``parse``)
    or as it streams (``stream``: a ``ToolCallStream`` per choice).

    A format's marker may be a special token of its family's vocabulary (Mistral's
    ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``), which the default
    ``skip_special_tokens`` deletes from the text: each parser reads its calls with or
    without the marker, so requests keep their own ``skip_special_tokens``.

    Attributes:
        name: the ``--tool-call-parser`` value.
    """

    name: ClassVar[str] = ""

    def stream(self) -> ToolCallStream:
        """A fresh streaming reader for one choice."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, or None when it is only whitespace; the calls) of a whole output: what
        its stream yields when fed the text at once, so streamed and whole answers agree."""
        events = self.stream().feed(text, final=True)
        content = "".join(v for k, v in events if k == "content")
        calls = [v for k, v in events if k == "call"]
        return (content if content.strip() else None), calls

    # the prompt of a template that ignores ``tools``: instructions and past calls as text
    def instructions(self, tools: list[ChatCompletionToolsParam]) -> str:
        """The system-message block that offers ``tools`` in this format."""
        lines = "\n".join(_dump({"type": "function", "function": t.function.model_dump(
            exclude_none=True)}) for t in tools)
        return ("# Tools\n\nYou can call functions to help answer the user. Their signatures, "
                f"one JSON object per line:\n<tools>\n{lines}\n</tools>\n\n{self.how_to_call}")

    how_to_call: ClassVar[str] = ""

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """Past calls (``{"function": {"name", "arguments": object}}``) as the model writes
        them."""
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        """A tool's result as the user turn that reports it."""
        return f"<tool_response>\n{content}\n</tool_response>"


class ToolCallStream:
    """The streaming reader of one choice: ``feed`` new text, get events; ``final`` once
    the choice finished (what was held back is flushed: calls that complete now, the rest as
    content)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.buf = ""
        self.pos = 0

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self.buf += text
        return self._scan(final)

    def _scan(self, final: bool) -> list[Event]:
        raise NotImplementedError


def _args_text(obj: dict[str, Any], *keys: str) -> str:
    args: Any = {}
    for k in keys:
        if k in obj:
            args = obj[k]
            break
    return args if isinstance(args, str) else _dump(args)


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


# Hermes -------------------------------------------------------------------------------------------


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5/Qwen3,
    Hermes), text around them content."""

    name = "hermes"
    how_to_call = ("To call a function, write a JSON object with its name and arguments "
                   "between <tool_call> and </tool_call>:\n"
                   f"{TOOL_CALL_START}\n" '{"name": "<function name>", "arguments": '
                   '{<arguments as JSON>}}\n' f"{TOOL_CALL_END}")

    def stream(self) -> ToolCallStream:
        return _HermesStream(self)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse_hermes(text)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{TOOL_CALL_START}\n" + _dump({
            "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + f"\n{TOOL_CALL_END}" for c in calls)


class _HermesStream(ToolCallStream):
    # the text between calls is content, held back while it could start "<tool_call>"
    def _scan(self, final: bool) -> list[Event]:
        out: list[Event] = []
        buf = self.buf
        while True:
            start = buf.find(TOOL_CALL_START, self.pos)
            if start < 0:
                self.pos = _flush_content(buf, self.pos, TOOL_CALL_START, final, out)
                return out
            if start > self.pos:
                out.append(("content", buf[self.pos:start]))
                self.pos = start
            end = buf.find(TOOL_CALL_END, start)
            if end < 0:
                if final:
                    call = _hermes_call(buf[start + len(TOOL_CALL_START):])
                    out.append(("call", call) if call else ("content", buf[start:]))
                    self.pos = len(buf)
                return out
            call = _hermes_call(buf[start + len(TOOL_CALL_START):end])
            stop = end + len(TOOL_CALL_END)
            out.append(("call", call) if call else ("content", buf[start:stop]))
            self.pos = stop


# Llama 3 JSON ---------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1/3.2/3.3's JSON calls (vLLM's ``llama3_json``): the whole output is one or
    more ``{"name": ..., "parameters": {...}}`` objects (``arguments`` is read too),
    separated by ``;``, optionally after ``<|python_tag|>``. An output that starts otherwise
    is content; one that starts like a call but is not one is content too, whole."""

    name = "llama3_json"
    how_to_call = ("To call a function, answer with only a JSON object of its name and "
                   'arguments, {"name": "<function name>", "parameters": {<arguments as '
                   "JSON>}}, and no other text.")

    def stream(self) -> ToolCallStream:
        return _WholeOutputStream(self, (PYTHON_TAG, "{"), _llama3_calls)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(_dump({"name": c["function"]["name"],
                                "parameters": c["function"]["arguments"]}) for c in calls)

    def render_result(self, content: str) -> str:
        return content


def _llama3_calls(text: str, final: bool) -> tuple[list[dict[str, Any]], int, bool]:
    """The complete calls of a Llama 3 JSON output (``text`` from after the marker), the
    position after the last one, and whether the text is still a well-formed sequence of
    calls (False: it is not calls after all)."""
    dec = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        i = _skip(text, pos, " \t\r\n;")
        if i >= len(text):
            return calls, pos, True
        if text[i] != "{":
            return calls, pos, False
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            return calls, pos, not final  # incomplete (or, at the end, broken)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return calls, pos, False
        calls.append(tool_call(obj["name"], _args_text(obj, "parameters", "arguments")))
        pos = end


class _WholeOutputStream(ToolCallStream):
    """Formats where the output is either calls from its first character or plain content
    (Llama 3 JSON, pythonic): held back until its start tells which; content then streams,
    calls are sent each once complete. Calls that turn out malformed make the whole output
    content, as the non-streamed answer reads it (nothing was sent yet unless earlier calls
    were whole; then only the rest is content)."""

    def __init__(self, parser: ToolCallParser, starts: tuple[str, ...],
                 calls: Callable[[str, bool], tuple[list[dict[str, Any]], int, bool]]
                 ) -> None:
        super().__init__(parser)
        self.starts = starts
        self.calls_of = calls
        self.mode: str | None = None  # None (undecided), "content" or "calls"
        self.body = 0  # where the calls begin (after the marker)
        self.sent = 0  # calls sent
        self.done = 0  # characters of the body the sent calls span

    def _scan(self, final: bool) -> list[Event]:
        buf = self.buf
        if self.mode is None:
            head = buf.lstrip()
            if not head and not final:
                return []
            marker = next((m for m in self.starts if head.startswith(m)), None)
            if marker is None and not final and any(
                    m.startswith(head) for m in self.starts):
                return []  # could still become a marker
            if marker is None:
                self.mode = "content"
            else:
                self.mode = "calls"
                lead = len(buf) - len(head)
                self.body = lead + (len(marker) if len(marker) > 1 else 0)
        if self.mode == "content":
            out = [("content", buf[self.pos:])] if len(buf) > self.pos else []
            self.pos = len(buf)
            return out
        calls, end, ok = self.calls_of(buf[self.body:], final)
        out: list[Event] = []
        if not ok:
            # not calls after all: what no call covered is content
            self.mode = "content"
            start = self.body + self.done if self.sent else 0
            self.pos = len(buf)
            return [("content", buf[start:])] if buf[start:] else []
        for c in calls[self.sent:]:
            out.append(("call", c))
        self.sent = len(calls)
        self.done = end
        if final:
            rest = buf[self.body + end:]
            if rest.strip():
                out.append(("content", rest))
            self.pos = len(buf)
        return out


# pythonic ---------------------------------------------------------------------------------------------

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolCallParser):
    """Calls as a Python list of calls with keyword arguments, ``[f(a=1), g(b="x")]``
    (vLLM's ``pythonic``: Llama 3.2 and Llama 4 prompts, ToolACE), optionally between
    ``<|python_start|>`` and ``<|python_end|>``; argument values are Python literals. An
    output that is not exactly such a list is content."""

    name = "pythonic"
    how_to_call = ("To call functions, answer with only a Python list of calls with keyword "
                   'arguments, [func_name1(param1="value", param2=2), func_name2(...)], and no '
                   "other text.")

    def stream(self) -> ToolCallStream:
        return _WholeOutputStream(self, (PYTHON_START, "["), _pythonic_calls)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        def call(c: dict[str, Any]) -> str:
            args = c["function"]["arguments"]
            kw = ", ".join(f"{k}={v!r}" for k, v in (args.items() if isinstance(args, dict)
                                                     else ()))
            return f"{c['function']['name']}({kw})"
        return "[" + ", ".join(call(c) for c in calls) + "]"

    def render_result(self, content: str) -> str:
        return content


def _pythonic_calls(text: str, final: bool) -> tuple[list[dict[str, Any]], int, bool]:
    """The calls of a pythonic output (``text`` from after ``<|python_start|>``, or from its
    ``[``) once the list is complete: all of them, the position after the list, and whether
    the text is (still) such a list."""
    end = text.find(PYTHON_END)
    body = text if end < 0 else text[:end]
    close = body.rfind("]")
    if close < 0:
        return [], 0, not final
    calls = parse_pythonic(body[:close + 1])
    if calls is None:
        # a "]" inside an argument, or not a list of calls: wait for more while streaming
        return [], 0, not final
    stop = close + 1 if end < 0 else end + len(PYTHON_END)
    return calls, stop, True


def parse_pythonic(text: str) -> list[dict[str, Any]] | None:
    """``[f(a=1), g(b="x")]`` as calls (arguments as JSON), or None when the text is not a
    list of calls by name with literal keyword arguments."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args and all(k.arg for k in node.keywords)):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            arguments = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append(tool_call(node.func.id, arguments))
    return calls


# Mistral -----------------------------------------------------------------------------------------------

TOOL_CALLS_TOKEN = "[TOOL_CALLS]"
_ARGS_TOKEN = "[ARGS]"


class MistralParser(ToolCallParser):
    """Mistral's ``[TOOL_CALLS]`` calls (vLLM's ``mistral``): after the marker a JSON list of
    ``{"name": ..., "arguments": {...}}`` (a single object is read too), or, as tokenizers
    from v11 write them, ``name[ARGS]{...}`` / ``name{...}`` per marker. Text before the
    marker is content. An output that starts with a list of objects is read as calls too:
    that is what is left when ``skip_special_tokens`` deleted the marker. Tool call ids are
    9 letters and digits, as Mistral's templates require."""

    name = "mistral"
    how_to_call = ("To call functions, write [TOOL_CALLS] followed by a JSON list of calls, "
                   '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as '
                   "JSON>}}], and nothing after it.")

    def stream(self) -> ToolCallStream:
        return _MistralStream(self)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return TOOL_CALLS_TOKEN + _dump([{"name": c["function"]["name"],
                                          "arguments": c["function"]["arguments"]}
                                         for c in calls])

    def render_result(self, content: str) -> str:
        return f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]"


class _MistralStream(ToolCallStream):
    def __init__(self, parser: ToolCallParser) -> None:
        super().__init__(parser)
        self.in_calls = False
        self.in_list = False
        self.started = False  # whether the output's start was looked at

    def _bare_list(self, final: bool) -> bool | None:
        """Whether the output starts with a list of objects (calls whose marker was
        skipped); None while too little of it is known."""
        head = self.buf.lstrip()
        if not head.startswith("["):
            return None if not head and not final else False
        rest = head[1:].lstrip()
        if not rest:
            return None if not final else False
        return rest.startswith("{")

    def _call(self, name: str, args: Any) -> Event:
        return ("call", tool_call(name, args if isinstance(args, str) else _dump(args),
                                  mistral_tool_call_id()))

    def _scan(self, final: bool) -> list[Event]:
        out: list[Event] = []
        buf, dec = self.buf, json.JSONDecoder()
        if not self.started:
            bare = self._bare_list(final)
            if bare is None:
                return out
            self.started = True
            if bare:
                self.in_calls = True
                self.pos = len(buf) - len(buf.lstrip())
        while True:
            if not self.in_calls:
                start = buf.find(TOOL_CALLS_TOKEN, self.pos)
                if start < 0:
                    self.pos = _flush_content(buf, self.pos, TOOL_CALLS_TOKEN, final, out)
                    return out
                if start > self.pos:
                    out.append(("content", buf[self.pos:start]))
                self.pos = start + len(TOOL_CALLS_TOKEN)
                self.in_calls = True
            i = _skip(buf, self.pos, " \t\r\n," if self.in_list else " \t\r\n")
            if i >= len(buf):
                if final:
                    self.pos = len(buf)
                return out
            if self.in_list and buf[i] == "]":
                self.in_list = self.in_calls = False
                self.pos = i + 1
                continue
            if not self.in_list and buf[i] == "[":
                self.in_list = True
                self.pos = i + 1
                continue
            if buf[i] == "{":
                try:
                    obj, end = dec.raw_decode(buf, i)
                except ValueError:
                    if final:
                        out.append(("content", buf[i:]))
                        self.pos = len(buf)
                    return out
                if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                    out.append(self._call(obj["name"], obj.get("arguments",
                                                                obj.get("parameters", {}))))
                else:
                    out.append(("content", buf[i:end]))
                self.pos = end
                if not self.in_list:
                    self.in_calls = False
                continue
            # v11: name[ARGS]{...} or name{...}
            brace = buf.find("{", i)
            if brace < 0:
                if final:
                    out.append(("content", buf[i:]))
                    self.pos = len(buf)
                return out
            name = buf[i:brace]
            if name.endswith(_ARGS_TOKEN):
                name = name[:-len(_ARGS_TOKEN)]
            try:
                args, end = dec.raw_decode(buf, brace)
            except ValueError:
                if final:
                    out.append(("content", buf[i:]))
                    self.pos = len(buf)
                return out
            if name.strip() and not any(c in name for c in '[]{}"\n'):
                out.append(self._call(name.strip(), args))
            else:
                out.append(("content", buf[i:end]))
            self.pos = end
            self.in_calls = False


#: ``--tool-call-parser`` values.
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}


def get_tool_call_parser(name: str | None) -> ToolCallParser:
    """The parser named ``name`` (None: Hermes, radixserve's default).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name is None:
        return HermesParser()
    cls = TOOL_CALL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser={name!r} is not one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}")
    return cls()


@dataclass
class ToolOutput:
    """How one choice's text is read: ``mode`` "auto" (by ``parser``: Hermes unless the
    server names another), "required" or "named".

    ``parallel`` false (``parallel_tool_calls: false``) keeps only the first call of an
    "auto" output ("required" is constrained to one item already)."""

    mode: str
    name: str | None = None
    parallel: bool = True
    parser: ToolCallParser = field(default_factory=lambda: HermesParser())

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
        return (cls("auto", parallel=req.parallel_tool_calls, parser=prompt.parser)
                if prompt.hermes else None)

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
        content, calls = self.parser.parse(text)
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

    A named call streams its arguments as they are generated; "required" and "auto" calls are
    sent whole when each one is complete (the text in between is content, held back while it
    could be the start of the parser's marker, such as ``<tool_call>``).
    """

    out: ToolOutput
    buf: str = ""
    pos: int = 0
    calls: int = 0
    started: bool = False
    reader: ToolCallStream | None = None

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
        if mode == "required":
            self.buf += text
            return self._feed_array(final)
        if self.reader is None:
            self.reader = self.out.parser.stream()
        out = []
        for kind, value in self.reader.feed(text, final):
            d = {"content": value} if kind == "content" else self._call_delta(value)
            if d is not None:
                out.append(d)
        return out

    def _feed_array(self, final: bool) -> list[dict[str, Any]]:
        # complete items of the array, each sent once the json module decodes it
        calls, self.pos = required_items(self.buf, self.pos)
        out = [d for d in map(self._call_delta, calls) if d is not None]
        if final and not self.calls and self.buf.strip():
            out.append({"content": self.buf})  # not an array of calls after all (cut short)
        return out


def _flush_content(buf: str, pos: int, marker: str, final: bool, out: list[Event]) -> int:
    """Emit ``buf[pos:]`` as content where no ``marker`` follows, holding back (unless
    ``final``) a tail that could be the marker's start; returns the new position."""
    keep = 0 if final else _partial_suffix(buf, marker, pos)
    if len(buf) - keep > pos:
        out.append(("content", buf[pos:len(buf) - keep]))
    return len(buf) - keep


def _partial_suffix(text: str, marker: str, lo: int) -> int:
    """Length of the longest suffix of ``text[lo:]`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text) - lo), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
