"""OpenAI request and response shapes: pydantic request models, their sampling parameters, errors.

Requests are validated strictly ("0.5" is not a number; strings must be valid Unicode) and unknown fields
are ignored, as OpenAI clients send many; fields that would change the answer and are not implemented are
refused unless their value asks for nothing (`UNSUPPORTED`). Differences from OpenAI, on purpose: temperature
defaults to 0 (greedy) when the field is absent, so the same request gives the same text (and `n` greedy choices
the same one). Extensions: `top_k`, `repetition_penalty`, `ignore_eos`, and vLLM's
`stream_options.continuous_usage_stats`.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moestream.engine.grammar import Structure
from moestream.errors import RequestError
from moestream.sampling import MAX_LOGPROBS, SEED_RANGE, SamplingParams

MAX_CHOICES = 64  # choices a request may ask for: prompts x n


class APIError(Exception):
    """Answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallPart(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallPart] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class JSONSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _Request(_Strict):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False

    def refuse_unsupported(self) -> None:
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name, None) if name in type(self).model_fields else (self.model_extra or {}).get(name)
            if value not in (None, False, [], {}) and not neutral(value):
                raise APIError(400, f"'{name}' is not supported by this server", param=name)

    def sampling_params(self, default_max_tokens: int, max_tokens_limit: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        if max_tokens > max_tokens_limit:
            param = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
            raise APIError(400, f"{param} = {max_tokens} is above this server's limit of {max_tokens_limit}",
                           param=param)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature or 0.0, top_p=self.top_p or 1.0,
                top_k=max(self.top_k or 0, 0), seed=self.seed, repetition_penalty=self.repetition_penalty or 1.0,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                stop=tuple(stops), ignore_eos=bool(self.ignore_eos))
        except RequestError as e:
            raise APIError(400, str(e), param=str(e).split()[0]) from None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    session_id: str | None = None  # this server's: the turn continues a session (server/sessions.py)

    def raw_messages(self) -> list[dict]:
        return [m.model_dump(exclude_none=True, by_alias=True) for m in self.messages]

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def structure(self) -> Structure | None:
        """The grammar response_format asks for (None for text)."""
        f = self.response_format
        if f is None or f.type == "text":
            return None
        if f.type == "json_schema" and (f.json_schema is None or f.json_schema.json_schema is None):
            raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                           param="response_format.json_schema")
        try:
            return Structure("json", f.json_schema.json_schema if f.type == "json_schema" else None)
        except RequestError as e:
            raise APIError(400, str(e), param="response_format") from None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts (strings or token ids): one, or a batch of them."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], str | list) else [p]
        if not p or not all(batch):
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(batch) * (self.n or 1) > MAX_CHOICES:
            raise APIError(400, f"{len(batch)} prompts x n = {self.n or 1} is over {MAX_CHOICES} choices a request",
                           param="prompt")
        return batch


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a raw prompt, or chat messages through the template (with tools)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# fields not implemented, each with the values that ask for nothing beyond None, false, [] and {}
UNSUPPORTED = {
    "suffix": lambda v: v == "", "functions": lambda v: False, "function_call": lambda v: v == "none",
    "logit_bias": lambda v: False, "best_of": lambda v: v == 1,
}


def _invalid_unicode(value, path: str = "") -> str | None:
    """The path of the first string in a decoded JSON value that is not valid Unicode (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        return next((p for k, v in value.items() if (p := _invalid_unicode(k, path) or
                                                      _invalid_unicode(v, f"{path}.{k}" if path else str(k)))), None)
    elif isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := _invalid_unicode(v, f"{path}.{i}"))), None)
    return None


def parse(model: type[BaseModel], data) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes an OpenAI-shaped 400."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if where := _invalid_unicode(data):
        raise APIError(400, f"{where}: the string is not valid Unicode (a lone surrogate)",
                       param=where.split(".")[0], code="invalid_unicode")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]  # its loc is the path to the value, with union members named ("prompt.str")
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}" if where else err["msg"],
                       param=str(err["loc"][0]) if err["loc"] else None, code=err["type"]) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
