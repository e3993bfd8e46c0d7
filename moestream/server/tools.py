"""OpenAI tool calling for Qwen models: request checks, chat-template messages, and tool calls parsed out of text.

A tool call in generated text is a block `<tool_call>BODY</tool_call>`; BODY is Qwen3's JSON object
{"name", "arguments"} or Qwen3-Coder / Qwen3-Next / Qwen3.5's `<function=NAME><parameter=KEY>VALUE</parameter>...
</function>`, whose raw values are typed by the tool's JSON schema. A block is a call only if it parses and names
one of the request's tools; otherwise its text stays in the content verbatim, as does a block left open at the end.
Blocks run from a `<tool_call>` to the first `</tool_call>` after it. Parsing never raises on model output.
`ToolCallStream` gives the same result piece by piece: its text events joined are exactly the text outside the
calls, which `parse_tool_calls` returns `.strip()`-ed; its calls equal the parsed ones but for their ids.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass

from moestream.server.protocol import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
# a parameter's value ends at its `</parameter>`, which models sometimes leave out before the next one or the end
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_NO = object()  # a value that did not convert


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of an object


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function a "named" choice forces


# ---- the request: tools, tool_choice, messages ----

def check_tools(tools, tool_choice) -> ToolChoice:
    """Validate the request's `tools` and `tool_choice` (decoded JSON); each problem is a 400 naming its field."""
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools: must be a list of function tools", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        names.add(_check_tool(tool, f"tools.{i}", names))
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if tool_choice == "none":
        return ToolChoice("none")
    if not names:
        raise APIError(400, "tool_choice: needs tools", param="tool_choice")
    if tool_choice in ("auto", "required"):
        return ToolChoice(tool_choice)
    if not isinstance(tool_choice, dict):
        raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or a function", param="tool_choice")
    if tool_choice.get("type") != "function":
        raise APIError(400, "tool_choice.type: must be 'function'", param="tool_choice.type")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice.function.name: must be a string", param="tool_choice.function.name")
    if name not in names:
        raise APIError(400, f"tool_choice.function.name: '{name}' is not among the tools",
                       param="tool_choice.function.name")
    return ToolChoice("named", name)


def _check_tool(tool, where: str, seen: set[str]) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"{where}.type: must be 'function'", param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"{where}.function: must be an object", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise APIError(400, f"{where}.function.name: must be 1-64 letters, digits, '_' or '-'",
                       param=f"{where}.function.name")
    if name in seen:
        raise APIError(400, f"{where}.function.name: '{name}' is given twice", param=f"{where}.function.name")
    # optional fields may also be null, as some clients send them
    for field, kind, what in (("description", str, "a string"), ("parameters", dict, "an object"),
                              ("strict", bool, "a boolean")):
        if function.get(field) is not None and not isinstance(function[field], kind):
            raise APIError(400, f"{where}.function.{field}: must be {what}", param=f"{where}.function.{field}")
    properties = (function.get("parameters") or {}).get("properties")
    if properties is not None and not (isinstance(properties, dict) and all(isinstance(p, dict)
                                                                            for p in properties.values())):
        raise APIError(400, f"{where}.function.parameters.properties: must map names to schemas",
                       param=f"{where}.function.parameters.properties")
    return name


def call_schema(tools: list[dict], name: str | None = None) -> dict:
    """The JSON schema of one Qwen3 JSON call object: for the function `name`, or any of the tools (anyOf)."""
    params = _parameters(tools)
    if name is not None and name not in params:
        raise APIError(400, f"tool_choice: '{name}' is not among the tools", param="tool_choice")
    if not params:
        raise APIError(400, "tools: none given", param="tools")

    def one(n: str) -> dict:
        return {"type": "object", "properties": {"name": {"const": n}, "arguments": params[n] or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
    return one(name) if name is not None else {"anyOf": [one(n) for n in params]}


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages (validated plain dicts) -> the messages HF chat templates take. Assistant tool calls
    keep their shape with `arguments` as a dict, since Qwen's templates `tojson` it or iterate its items."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": _text(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = [_template_call(call, f"messages.{i}.tool_calls.{j}")
                                     for j, call in enumerate(m["tool_calls"])]
        if role == "tool":
            message.update({k: m[k] for k in ("tool_call_id", "name") if m.get(k) is not None})
        out.append(message)
    return out


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content or [])


def _template_call(call: dict, where: str) -> dict:
    function = call.get("function") or {}
    if not isinstance(function.get("name"), str):
        raise APIError(400, f"{where}.function.name: must be a string", param=f"{where}.function.name")
    arguments = _json(function.get("arguments")) if isinstance(function.get("arguments"), str) else _NO
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments: must be the JSON text of an object",
                       param=f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    return {"id": call["id"], **out} if call.get("id") is not None else out


# ---- generated text: tool-call blocks ----

def parse_tool_calls(text: str, tools: list[dict]) -> tuple[str, list[ToolCall]]:
    """The content (text outside the calls, stripped) and the tool calls of a whole generated text, in order."""
    params = _parameters(tools)
    content, calls, at = [], [], 0
    while (start := text.find(OPEN, at)) >= 0 and (end := text.find(CLOSE, start + len(OPEN))) >= 0:
        end += len(CLOSE)
        call = _parse_block(text[start:end], params)
        content.append(text[at:start] if call else text[at:end])
        calls += [call] if call else []
        at = end
    content.append(text[at:])
    return "".join(content).strip(), calls


class ToolCallStream:
    """Events from generated text piece by piece: ("text", str) as it arrives, but for a tail that may begin
    `<tool_call>` (held back until it cannot), and ("call", ToolCall) once a block closes and parses."""

    def __init__(self, tools: list[dict]):
        self.params = _parameters(tools)
        self.pending = ""  # held back: a possible start of OPEN, or the open block so far
        self.in_block = False

    def feed(self, piece: str) -> list[tuple]:
        self.pending += piece
        events = []
        while True:
            if self.in_block:
                if (end := self.pending.find(CLOSE)) < 0:
                    return events
                block, self.pending = self.pending[:end + len(CLOSE)], self.pending[end + len(CLOSE):]
                self.in_block = False
                call = _parse_block(block, self.params)
                events.append(("call", call) if call else ("text", block))
                continue
            start = self.pending.find(OPEN)
            cut = start if start >= 0 else len(self.pending) - _open_prefix(self.pending)
            if cut:
                events.append(("text", self.pending[:cut]))
                self.pending = self.pending[cut:]
            if start < 0:
                return events
            self.in_block = True

    def close(self) -> list[tuple]:
        """The held-back text, and a block still open, as text."""
        rest, self.pending, self.in_block = self.pending, "", False
        return [("text", rest)] if rest else []


def _open_prefix(text: str) -> int:
    """The length of the longest tail of `text` that begins OPEN (but is not all of it)."""
    return next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), 0)


def _parameters(tools: list[dict]) -> dict[str, dict]:
    """Function name -> its parameters schema ({} when absent), for the function tools."""
    functions = (t.get("function") for t in tools or [] if isinstance(t, dict) and t.get("type") == "function")
    return {f["name"]: f.get("parameters") or {} for f in functions if isinstance(f, dict)
            and isinstance(f.get("name"), str)}


def _parse_block(block: str, params: dict[str, dict]) -> ToolCall | None:
    """The call in one `<tool_call>...</tool_call>` block, or None if it is malformed or names no tool."""
    body = block[len(OPEN):-len(CLOSE)].strip()
    parsed = _parse_json_call(body, params) if body.startswith("{") else _parse_xml_call(body, params)
    if parsed is None:
        return None
    name, arguments = parsed
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _parse_json_call(body: str, params: dict[str, dict]) -> tuple[str, dict] | None:
    call = _json(body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in params:
        return None
    arguments = call.get("arguments", {})
    arguments = _json(arguments) if isinstance(arguments, str) else arguments  # some models quote the object
    if not isinstance(arguments, dict):
        return None
    properties = _properties(params[call["name"]])
    # models sometimes quote numbers and booleans; a value a string may be is left alone
    for key, value in arguments.items():
        types = _types(properties.get(key))
        if isinstance(value, str) and "string" not in types:
            arguments[key] = _typed(value, [t for t in types if t in ("integer", "number", "boolean")], value)
    return call["name"], arguments


def _parse_xml_call(body: str, params: dict[str, dict]) -> tuple[str, dict] | None:
    match = FUNCTION.fullmatch(body)
    if match is None or (name := match[1].strip()) not in params:
        return None
    properties, inner, arguments, at = _properties(params[name]), match[2], {}, 0
    while inner[at:].strip():
        if (param := PARAMETER.match(inner, at)) is None:
            return None
        key, raw = param[1].strip(), param[2].removeprefix("\n").removesuffix("\n")
        arguments[key] = _typed(raw, _types(properties.get(key)), raw)
        at = param.end()
    return name, arguments


def _properties(parameters: dict) -> dict:
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties if isinstance(properties, dict) else {}


def _types(schema) -> list[str]:
    """The JSON types a property schema allows, in order: its `type` (a name or a list), else its anyOf/oneOf's."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str | list):
        return [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)]
    members = schema.get("anyOf") or schema.get("oneOf")
    return [k for m in members for k in _types(m)] if isinstance(members, list) else []


def _typed(raw: str, types: list[str], default):
    """`raw` as the first of `types` it parses as, else `default`."""
    for kind in types:
        if (value := _convert(raw, kind)) is not _NO:
            return value
    return default


def _convert(raw: str, kind: str):
    if kind == "string":
        return raw
    if kind == "boolean":
        return {"true": True, "false": False}.get(raw.strip().lower(), _NO)
    value = _json(raw)
    if kind == "integer":
        return value if type(value) is int else _NO
    if kind == "number":
        return value if type(value) in (int, float) else _NO
    wanted = {"object": dict, "array": list, "null": type(None)}.get(kind)
    return value if wanted is not None and type(value) is wanted else _NO


def _json(text: str):
    """The JSON value of `text`, or _NO. NaN and infinities are refused: json.dumps would write them as non-JSON."""
    try:
        return json.loads(text, parse_constant=_finite, parse_float=_finite)
    except (ValueError, RecursionError):
        return _NO


def _finite(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise ValueError(text)
    return value
