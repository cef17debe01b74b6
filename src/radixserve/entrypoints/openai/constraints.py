"""From a request's constraint fields to the engine's ``StructuredOutputsParams``:
``response_format`` (OpenAI), ``structured_outputs`` and the older ``guided_*`` fields (vLLM),
and ``tool_choice`` "required" or a named function (the functions' JSON schemas, as vLLM
constrains them). At most one of them may be set.
"""

from __future__ import annotations

from typing import Any

from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    NamedToolChoice,
)
from radixserve.sampling_params import StructuredOutputsParams

#: A function without a ``parameters`` schema takes an object (OpenAI's rule).
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_parameters(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    """The JSON schema of a function's arguments (an empty object schema when none)."""
    return tool.function.parameters or EMPTY_PARAMETERS


def required_tools_schema(tools: list[ChatCompletionToolsParam],
                          parallel: bool) -> dict[str, Any]:
    """The JSON schema of a ``tool_choice: "required"`` output: an array of at least one
    ``{"name": <one of the functions>, "parameters": <its arguments>}`` (vLLM's shape; at most
    one item when ``parallel_tool_calls`` is false). ``$defs`` of the functions' schemas are
    lifted to the top so their ``$ref``s resolve.

    Raises:
        OpenAIError: two functions define the same ``$defs`` name differently.
    """
    defs: dict[str, Any] = {}
    items = []
    for t in tools:
        params = dict(tool_parameters(t))
        for name, d in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != d:
                raise OpenAIError(f"tools define $defs/{name} twice with different schemas",
                                  param="tools")
            defs[name] = d
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"anyOf": items} if len(items) > 1 else items[0]}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _from_fields(req: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every constraint the request sets: (field name, ``StructuredOutputsParams`` kwargs)."""
    out: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        out.append(("response_format", {"json": rf.json_schema.json_schema}))
    so = req.structured_outputs
    if so is not None:
        kw = {k: v for k, v in (("json", so.json_schema), ("regex", so.regex),
                                ("choice", so.choice), ("grammar", so.grammar),
                                ("json_object", so.json_object)) if v is not None}
        kw["disable_any_whitespace"] = so.disable_any_whitespace
        kw["disable_additional_properties"] = so.disable_additional_properties
        out.append(("structured_outputs", kw))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            out.append((field, {key: value}))
    if isinstance(req, ChatCompletionRequest) and req.tools:
        choice = req.effective_tool_choice
        # Tool calls are compact JSON: a client parses the arguments, never reads their layout,
        # and a small model let free on whitespace spends its max_tokens on newlines and
        # indentation (SmolLM2 ran out of 80 tokens inside one call) and returns no call at all.
        if choice == "required":
            out.append(("tool_choice", {"json": required_tools_schema(
                req.tools, req.parallel_tool_calls), "disable_any_whitespace": True}))
        elif isinstance(choice, NamedToolChoice):
            tool = next(t for t in req.tools if t.function.name == choice.function.name)
            out.append(("tool_choice", {"json": tool_parameters(tool),
                                        "disable_any_whitespace": True}))
    return out


def structured_outputs_for(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from ((None, None) without one).

    Raises:
        OpenAIError: 400 when two fields constrain the output, or the constraint is malformed
            (none or several kinds in ``structured_outputs``, an empty choice list); whether it
            compiles is checked by ``ServingState.check_constraint``.
    """
    found = _from_fields(req)
    if not found:
        return None, None
    if len(found) > 1:
        names = " and ".join(f for f, _ in found)
        raise OpenAIError(f"{names} both constrain the output; set only one of them",
                          param=found[1][0])
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except ValueError as e:
        raise OpenAIError(str(e), param=field) from None
