"""A chat body's `tools`, `tool_choice` and `parallel_tool_calls` -> what the request does with them.

vLLM's rules: `tool_choice` defaults to "auto" when tools are given, "none" otherwise; any
other choice without tools is refused. The tools are rendered through the chat template for
every choice ("none" included: the model knows them but is not read for calls).
- "auto": the answer is read by the server's tool-call parser (`--enable-auto-tool-choice
  --tool-call-parser hermes`); a server without one refuses it.
- "required": structured output forces a JSON array of calls, each `{"name": one of the tools,
  "parameters": that tool's parameters}`; at least one, exactly one when parallel_tool_calls
  is false.
- a named function `{"type": "function", "function": {"name": ...}}`: structured output forces
  that function's parameters schema; the name must be one of the tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.sampling_params import StructuredOutputsParams
from pagedllm.entrypoints.chat_utils import check_tools
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.parsing import get
from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolCall,
    RequiredToolCalls,
    ToolCallReader,
)

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolUse:
    """`tools` for the template (None: no tools), the reader of the answer (None: plain text) and
    the structured output that enforces the choice (None: not enforced)."""

    tools: list[dict[str, Any]] | None = None
    reader: ToolCallReader | None = None
    structured: StructuredOutputsParams | None = None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _EMPTY_PARAMETERS


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls to the tools (one `anyOf` branch per tool, its name a const)."""
    branches = []
    defs: dict[str, Any] = {}
    for t in tools:
        params = dict(_parameters(t))
        defs.update(params.pop("$defs", {}))  # `$ref`s point to the root's $defs
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def check_tools_400(tools: list[Any]) -> list[dict[str, Any]] | None:
    """The body's tools checked (a 400 naming the one at fault); None for []."""
    try:
        return check_tools(tools) or None
    except InvalidRequestError as e:
        raise bad_request(e.message, e.param) from None


def _legacy_functions(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's older `functions` / `function_call` as `tools` / `tool_choice` (answers carry
    `tool_calls`, the current form)."""
    functions, call = body.get("functions"), body.get("function_call")
    if functions is None and call is None:
        return body
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        raise bad_request("send tools and tool_choice, or the older functions and function_call, not both", "functions")
    functions = get(body, "functions", "list", [])
    tools = [{"type": "function", "function": f} for f in functions]
    if isinstance(call, dict):
        call = {"type": "function", "function": call}
    return {**body, "tools": tools or None, "tool_choice": call}


def tool_use(body: dict[str, Any], tool_parser: str | None) -> ToolUse:
    """What the body's tool fields ask for; a mistake is a 400 naming the field."""
    body = _legacy_functions(body)
    tools = get(body, "tools", "list")
    tools = check_tools_400(tools) if tools is not None else None
    parallel = get(body, "parallel_tool_calls", "bool", True)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolUse(tools)
    if not tools:
        raise bad_request("tool_choice other than \"none\" needs 'tools'", "tool_choice")
    if choice == "auto":
        if tool_parser is None:
            raise bad_request(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                '--tool-call-parser; send tool_choice "none", "required" or a named function',
                "tool_choice",
            )
        return ToolUse(tools, TOOL_PARSERS[tool_parser](max_calls=None if parallel else 1))
    if choice == "required":
        return ToolUse(tools, RequiredToolCalls(), StructuredOutputsParams(json=required_schema(tools, parallel)))
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    named = [t for t in tools if t["function"]["name"] == fn["name"]]
    if not named:
        raise bad_request(f"tool_choice names the function {fn['name']!r}, which is not in 'tools'", "tool_choice")
    return ToolUse(tools, NamedToolCall(fn["name"]), StructuredOutputsParams(json=_parameters(named[0])))
