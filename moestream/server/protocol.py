"""OpenAI request and response shapes: pydantic request models, their sampling parameters, errors.

Requests are validated strictly ("0.5" is not a number; strings must be valid Unicode) and unknown fields
are ignored, as OpenAI clients send many; fields that would change the answer and are not implemented are
refused unless their value asks for nothing (`UNSUPPORTED`). Differences from OpenAI, on purpose: temperature
defaults to 0 (greedy) when the field is absent, so the same request gives the same text (and `n` greedy choices
the same one). Extensions: `top_k`, `repetition_penalty`, `ignore_eos`, and vLLM's
`stream_options.continuous_usage_stats`.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moestream.errors import RequestError
from moestream.sampling import SEED_RANGE, SamplingParams

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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


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
    top_logprobs: int | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
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


# fields not implemented yet, each with the values that ask for nothing beyond None, false, [] and {}
UNSUPPORTED = {
    "logprobs": lambda v: False, "top_logprobs": lambda v: v == 0, "echo": lambda v: False,
    "suffix": lambda v: v == "", "tools": lambda v: False, "functions": lambda v: False,
    "function_call": lambda v: v == "none", "tool_choice": lambda v: v in ("none", "auto"),
    "parallel_tool_calls": lambda v: False, "response_format": lambda v: v == {"type": "text"},
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason, reason)


class Shapes:
    """Builds the response objects of one request (chat or text completion), streaming or not."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _choice(self, index: int, text: str | None, reason: str | None, final: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        if final:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason}
        delta = ({"role": "assistant", "content": ""} if first else {"content": text}) if text is not None else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def _object(self, kind: str, choices: list, use: dict | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if use is not None:
            out["usage"] = use
        return out

    def response(self, choices: list[tuple[str, str | None]], use: dict) -> dict:
        """choices: (text, finish reason) in index order."""
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [self._choice(i, text, finish_reason(reason), final=True)
                                   for i, (text, reason) in enumerate(choices)], use)

    def chunk(self, index: int, text: str | None, reason: str | None = None, first: bool = False) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [self._choice(index, text, finish_reason(reason), final=False, first=first)])

    def usage_chunk(self, use: dict) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], use)
