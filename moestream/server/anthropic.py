"""Anthropic Messages API shapes (POST /v1/messages), translated to and from the server's OpenAI chat path.

`parse_request(body)` validates a request: each wrong type or value is an `APIError(400)` whose `param` names the
field. `to_chat(req)` gives the request in the chat form the OpenAI path takes; `message(...)` builds the response,
`MessageStream` its SSE events, `error_body(status, message)` an Anthropic-shaped error. A tool call is anything
with `.id`, `.name` and `.arguments` (the JSON text of an object). Differences from Anthropic, on purpose:
temperature is greedy (0) when absent, the server's rule for the same request to give the same text (Anthropic's
default is 1.0); images, documents, server tools, MCP servers, structured output and extended thinking are refused
with a 400; 503 (the server stopping) is Anthropic's 529 `overloaded_error`.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal, Protocol, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from moestream.server.protocol import APIError, _Strict, parse

# Anthropic fields that would change the answer and are not implemented: refused unless empty
REFUSED = ("mcp_servers", "container", "context_management", "output_format")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}
CHOICE_MODES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice -> OpenAI's


def _str_or_list(block):
    """str, or a list of `block`; the branch is picked by the value's type, so an error is about that branch."""
    branch = Discriminator(lambda v: "str" if isinstance(v, str) else "list" if isinstance(v, list) else None,
                           custom_error_type="content_type", custom_error_message="Input should be a string or a list "
                           "of content blocks")
    return Annotated[Union[Annotated[str, Tag("str")], Annotated[list[block], Tag("list")]], branch]  # noqa: UP007


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class MediaBlock(_Strict):
    """An image or a document: the models served read text only."""
    type: Literal["image", "document"]

    @model_validator(mode="after")
    def refuse(self):
        raise PydanticCustomError("unsupported", f"{self.type} blocks are not supported by this server (text only)")


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


ResultPart = Annotated[TextBlock | MediaBlock, Field(discriminator="type")]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: _str_or_list(ResultPart) | None = None
    is_error: bool = False

    def text(self) -> str:
        text = _joined(self.content or "")
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | MediaBlock, Field(discriminator="type")]


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: _str_or_list(ContentBlock)

    @model_validator(mode="after")
    def blocks_fit_the_role(self):
        wrong, home = ("tool_result", "user") if self.role == "assistant" else ("tool_use", "assistant")
        if isinstance(self.content, list) and any(b.type == wrong for b in self.content):
            raise PydanticCustomError("invalid_block", f"{wrong} blocks belong in {home} messages")
        return self


class Tool(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict

    @model_validator(mode="before")
    @classmethod
    def custom_only(cls, data):
        # server tools (web search, code execution, ...) name a versioned `type` and run on Anthropic's side
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise PydanticCustomError("unsupported", "server tool '{kind}' is not supported; only custom tools "
                                      "(name, description, input_schema) are", {"kind": str(data["type"])})
        return data


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def named_when_tool(self):
        if self.type == "tool" and not self.name:
            raise PydanticCustomError("missing", "a tool_choice of type 'tool' needs the tool's 'name'")
        return self


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]

    @model_validator(mode="after")
    def refuse_thinking(self):
        if self.type != "disabled":
            raise PydanticCustomError("unsupported", "extended thinking is not supported by this server")
        return self


class MessagesRequest(_Strict):
    """POST /v1/messages; `metadata`, `service_tier` and other fields not named here are ignored."""
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: _str_or_list(TextBlock) | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("tool_choice")
    @classmethod
    def choice_fits_tools(cls, choice, info):
        names = {t.name for t in info.data.get("tools") or []}
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise PydanticCustomError("invalid_tool_choice", f"tool_choice '{choice.type}' needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise PydanticCustomError("invalid_tool_choice", f"tool_choice names '{choice.name}', not in tools")
        return choice


def parse_request(data) -> MessagesRequest:
    """Validate a decoded JSON body (protocol.parse), then refuse the fields this server does not implement."""
    req = parse(MessagesRequest, data)
    extra = req.model_extra or {}
    for name in REFUSED:
        if extra.get(name) not in (None, [], {}):
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
    if isinstance(extra.get("output_config"), dict) and extra["output_config"].get("format") is not None:
        raise APIError(400, "output_config.format (structured output) is not supported by this server",
                       param="output_config")
    return req


def is_prefill(req: MessagesRequest) -> bool:
    """A final assistant message is the start of the answer, which the model continues (Anthropic's prefill);
    it must be text."""
    last = req.messages[-1]
    if last.role != "assistant":
        return False
    if not isinstance(last.content, str) and any(b.type != "text" for b in last.content) or not _joined(last.content):
        raise APIError(400, "a final assistant message (a prefill) must be non-empty text", param="messages")
    return True


def _joined(content) -> str:
    # blocks are separate passages: a newline keeps the last word of one from running into the next
    return content if isinstance(content, str) else "\n".join(b.text for b in content if b.type == "text")


def to_chat(req: MessagesRequest) -> dict:
    """The request in the server's OpenAI chat form. `temperature` stays None when absent: the server then
    samples greedily (Anthropic would use 1.0). `parallel_tool_calls` is False for `disable_parallel_tool_use`."""
    messages = [{"role": "system", "content": _joined(req.system)}] if req.system else []
    for m in req.messages:
        messages += _chat_messages(m)
    choice = req.tool_choice
    return {"model": req.model, "messages": messages,
            "tools": [_chat_tool(t) for t in req.tools] if req.tools else None,
            "tool_choice": None if choice is None else CHOICE_MODES.get(choice.type)
            or {"type": "function", "function": {"name": choice.name}},
            "parallel_tool_calls": False if choice is not None and choice.disable_parallel_tool_use else None,
            "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "stop": list(req.stop_sequences or []), "stream": req.stream}


def _chat_messages(m: MessageParam) -> list[dict]:
    """One Anthropic message as OpenAI messages: a user's tool results become `tool` messages ahead of its text."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts = [b for b in m.content if b.type == "text"]
    if m.role == "assistant":
        out = {"role": "assistant", "content": _joined(texts)}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in m.content if b.type == "tool_use"]
        return [{**out, "tool_calls": calls} if calls else out]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in m.content if b.type == "tool_result"]
    return results + ([{"role": "user", "content": _joined(texts)}] if texts or not results else [])


def _chat_tool(tool: Tool) -> dict:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


# ---- responses ----

class Call(Protocol):
    id: str
    name: str
    arguments: str  # the JSON text of an object


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id(call_id: str) -> str:
    """Anthropic clients expect 'toolu_' ids: 'call_x' becomes 'toolu_x', an id without either prefix gains it."""
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason_of(finish_reason: str | None, stopped_at: str | None, has_calls: bool) -> str:
    if has_calls:
        return "tool_use"
    if stopped_at is not None:
        return "stop_sequence"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def _input(arguments: str) -> dict:
    value = json.loads(arguments or "{}")
    if not isinstance(value, dict):
        raise ValueError(f"a tool call's arguments must be a JSON object, not {arguments[:80]!r}")
    return value


def message(id: str, model: str, text: str, calls: list[Call], stop_reason: str | None, stop_sequence: str | None,
            input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """The Message object. input_tokens: the whole prompt, cached_tokens of it read from the prefix cache (Anthropic's
    usage.input_tokens leaves those out: the prompt is input_tokens + cache_read_input_tokens)."""
    content = ([{"type": "text", "text": text}] if text else []) + [
        {"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": _input(c.arguments)} for c in calls]
    return {"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens - cached_tokens, "output_tokens": output_tokens,
                      "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}}


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessageStream:
    """The SSE events of one streamed message, in the order the client's accumulator needs: message_start, each
    content block's start, deltas and stop (one block open at a time), then message_delta and message_stop."""

    def __init__(self, id: str, model: str):
        self.id, self.model = id, model
        self.blocks = 0  # content blocks started; the open one, if any, is the last
        self.text_open = False  # a tool_use block opens and closes in one call(), so only text stays open

    def start(self, input_tokens: int, cached_tokens: int = 0) -> str:
        # output_tokens is 0 here: message_delta's count replaces it
        start = message(self.id, self.model, "", [], None, None, input_tokens, 0, cached_tokens)
        return (_event("message_start", {"type": "message_start", "message": start})
                + _event("ping", {"type": "ping"}))

    def text(self, piece: str) -> str:
        if not piece:
            return ""
        out = "" if self.text_open else self._block_start({"type": "text", "text": ""})
        self.text_open = True
        return out + self._delta({"type": "text_delta", "text": piece})

    def call(self, call: Call) -> str:
        arguments = _input(call.arguments)  # message()'s check, before any event: both paths refuse the same calls
        out = self._close() + self._block_start({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                                                 "input": {}})
        if arguments:
            out += self._delta({"type": "input_json_delta", "partial_json": json.dumps(arguments)})
        return out + self._block_stop()

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> str:
        return (self._close()
                + _event("message_delta", {"type": "message_delta", "usage": {"output_tokens": output_tokens},
                                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}})
                + _event("message_stop", {"type": "message_stop"}))

    def error(self, status: int, message: str) -> str:
        return _event("error", error_body(status, message))

    def _block_start(self, block: dict) -> str:
        self.blocks += 1
        return _event("content_block_start", {"type": "content_block_start", "index": self.blocks - 1,
                                              "content_block": block})

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1,
                                              "delta": delta})

    def _block_stop(self) -> str:
        return _event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})

    def _close(self) -> str:
        if not self.text_open:
            return ""
        self.text_open = False
        return self._block_stop()
