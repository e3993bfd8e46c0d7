"""One engine thread that owns the `LLM`, fed by a bounded queue of jobs.

Contract: `submit` never blocks; it raises `QueueFull` when `max_queue` jobs already wait behind the
running one. The engine thread runs jobs one at a time and delivers events to the submitting event
loop: ("text", piece) as text arrives, then ("done", RequestOutput) or ("error", exception). A job whose
`cancel` is set is skipped if it has not started, and stopped after its current token if it has, so an
abandoned request frees the engine within one decode step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from moestream.engine.stream import TextStream
from moestream.errors import RequestError
from moestream.sampling import SamplingParams

log = logging.getLogger("moestream.server")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    """A job refused or stopped because the server is stopping (503)."""


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: the server is shutting down
            self.cancel.set()


class EngineWorker:
    def __init__(self, llm, max_queue: int):
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.llm = llm
        self.max_queue = max_queue
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.running: Job | None = None
        self.counts = dict(completed=0, cancelled=0, failed=0, rejected=0)
        self.busy_seconds = 0.0
        self.fault: str | None = None  # the engine's last own failure, until a request completes again
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="moestream-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        if self.stopping:
            raise ShuttingDown
        job = Job(prompt_ids, params, asyncio.get_running_loop())
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise QueueFull from None
        return job

    def cancel_all(self) -> None:
        """Stop the running job after its current token and fail the waiting ones (the server is stopping)."""
        self.stopping = True
        if (running := self.running) is not None:
            running.cancel.set()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.emit("error", ShuttingDown("the server is shutting down"))

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel everything, then end the thread."""
        self.cancel_all()
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(timeout)

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancel.is_set():
                self.counts["cancelled"] += 1
                continue
            self.running, job.started_at = job, time.monotonic()
            try:
                self._run(job)
            finally:
                self.running = None
                self.busy_seconds += time.monotonic() - job.started_at

    def _run(self, job: Job) -> None:
        stream = TextStream(self.llm, job.prompt_ids, job.params, cancelled=job.cancel.is_set)
        try:
            for piece in stream:
                job.emit("text", piece)
            out = stream.output()
        except Exception as e:  # no failure may take the engine thread down
            if not isinstance(e, RequestError):  # the engine's own fault: /health says so until a request succeeds
                log.exception("generation failed")
                self.fault = f"{type(e).__name__}: {e}"
            self.counts["failed"] += 1
            job.emit("error", e)
            return
        self.fault = None
        self.counts["cancelled" if out.finish_reason == "cancelled" else "completed"] += 1
        job.emit("done", out)
