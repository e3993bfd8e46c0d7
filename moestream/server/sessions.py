"""Server-side chat sessions (Cherenkov's shape): `POST /v1/sessions` makes one with settings (sampling fields every
turn takes unless it sets them) and perhaps first messages (a system prompt); a chat request with `session_id`
sends only its new messages, which follow the committed ones; `GET` shows the committed messages, settings and
usage; `DELETE` ends an idle session.

A turn is transactional: its messages and its answer are committed only when it completes (a stop, the length
limit or tool calls), never when it is cancelled or fails; a session runs one turn at a time (409 while one runs).
Sessions idle for `idle_s` expire; the committed messages of all sessions stay within `budget_bytes` (the least
recently used idle sessions go first; a session that alone would pass it is refused the turn, 400). A turn's
prompt is the whole conversation through the chat template: the prefix cache, shared by every request, restores
it up to the last prefill boundary before the new messages, so a turn's tokens are a stateless request's with
the same messages. All calls run on the event loop's thread.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from pydantic import Field

from moestream.server.protocol import APIError, ChatMessage, _Strict

SETTINGS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens", "stop",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "tools", "tool_choice")


class SessionRequest(_Strict):
    """POST /v1/sessions. `settings` are checked again as fields of each turn's chat request."""

    model: str | None = None
    messages: list[ChatMessage] = Field(default_factory=list)
    settings: dict = Field(default_factory=dict)

    def check(self) -> None:
        for name in self.settings:
            if name not in SETTINGS:
                raise APIError(400, f"settings.{name}: not a session setting (one of {', '.join(SETTINGS)})",
                               param=f"settings.{name}")


@dataclass
class Session:
    id: str
    settings: dict
    messages: list[dict]
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    active: bool = False
    usage: dict = field(default_factory=lambda: dict(turns=0, prompt_tokens=0, completion_tokens=0, cached_tokens=0))

    @property
    def nbytes(self) -> int:
        return len(json.dumps(self.messages, ensure_ascii=False).encode())

    def card(self, idle_s: float) -> dict:
        return {"id": self.id, "object": "session", "created": int(self.created), "messages": self.messages,
                "settings": self.settings, "usage": dict(self.usage), "active": self.active,
                "expires_in_seconds": None if self.active else max(0.0, idle_s - (time.monotonic() - self.last_used))}


class Sessions:
    def __init__(self, max_sessions: int = 64, budget_bytes: int = 16 << 20, idle_s: float = 900.0):
        self.max_sessions, self.budget_bytes, self.idle_s = max_sessions, budget_bytes, idle_s
        self.by_id: dict[str, Session] = {}
        self.counts = dict(created=0, expired=0, evicted=0, deleted=0)

    def create(self, req: SessionRequest) -> Session:
        req.check()
        self._expire()
        if len(self.by_id) >= self.max_sessions and not self._evict_one():
            raise APIError(429, f"{self.max_sessions} sessions are running turns; retry later",
                           type="rate_limit_error", code="too_many_sessions")
        session = Session(f"sess-{uuid.uuid4().hex[:24]}", dict(req.settings),
                          [m.model_dump(exclude_none=True) for m in req.messages])
        self._fit(session, session.nbytes)
        self.by_id[session.id] = session
        self.counts["created"] += 1
        return session

    def get(self, session_id: str) -> Session:
        self._expire()
        session = self.by_id.get(session_id)
        if session is None:
            raise APIError(404, f"session '{session_id}' does not exist (or expired)", param="session_id",
                           code="session_not_found")
        return session

    def delete(self, session_id: str) -> None:
        session = self.get(session_id)
        if session.active:
            raise APIError(409, f"session '{session_id}' is running a turn", param="session_id", code="session_busy")
        del self.by_id[session_id]
        self.counts["deleted"] += 1

    def begin(self, session_id: str, body: dict) -> tuple[Session, dict]:
        """Start a turn: the session, and the chat request body with its settings and committed messages."""
        session = self.get(session_id)
        if session.active:
            raise APIError(409, f"session '{session_id}' is running a turn", param="session_id", code="session_busy")
        if body.get("n", 1) != 1:
            raise APIError(400, "a session's turn has one choice (n = 1)", param="n")
        if not isinstance(body.get("messages"), list):
            raise APIError(400, "messages: a turn sends its new messages as a list", param="messages")
        session.active, session.last_used = True, time.monotonic()
        merged = {**session.settings, **body, "messages": session.messages + body["messages"]}
        return session, merged

    def commit(self, session: Session, new_messages: list[dict], answer: dict, use: dict) -> None:
        """The turn completed: its messages and answer join the session, and its usage is counted."""
        added = new_messages + [answer]
        self._fit(session, session.nbytes + len(json.dumps(added, ensure_ascii=False).encode()))
        session.messages += added
        u = session.usage
        u["turns"] += 1
        u["prompt_tokens"] += use["prompt_tokens"]
        u["completion_tokens"] += use["completion_tokens"]
        u["cached_tokens"] += use["prompt_tokens_details"]["cached_tokens"]

    def end(self, session: Session) -> None:
        session.active, session.last_used = False, time.monotonic()

    def stats(self) -> dict:
        return {"sessions": len(self.by_id), "bytes": sum(s.nbytes for s in self.by_id.values()),
                "budget_bytes": self.budget_bytes, **self.counts}

    def _fit(self, session: Session, nbytes: int) -> None:
        """Make room for `session` to hold `nbytes`: idle sessions leave, least recently used first."""
        if nbytes > self.budget_bytes:
            raise APIError(400, f"the session would hold {nbytes} bytes of messages; the limit is {self.budget_bytes}",
                           param="messages", code="session_too_large")
        others = sum(s.nbytes for s in self.by_id.values() if s is not session)
        while others + nbytes > self.budget_bytes:
            freed = self._evict_one(keep=session)
            if not freed:
                raise APIError(429, "the sessions' memory is held by running turns; retry later",
                               type="rate_limit_error", code="sessions_full")
            others -= freed

    def _evict_one(self, keep: Session | None = None) -> int:
        """Evict the least recently used idle session; its bytes (0 when none is idle)."""
        idle = [s for s in self.by_id.values() if not s.active and s is not keep]
        if not idle:
            return 0
        oldest = min(idle, key=lambda s: s.last_used)
        del self.by_id[oldest.id]
        self.counts["evicted"] += 1
        return oldest.nbytes or 1

    def _expire(self) -> None:
        now = time.monotonic()
        for s in [s for s in self.by_id.values() if not s.active and now - s.last_used > self.idle_s]:
            del self.by_id[s.id]
            self.counts["expired"] += 1
