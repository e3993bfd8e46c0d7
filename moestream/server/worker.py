"""One engine thread that owns the `LLM`, fed by a bounded queue of jobs.

Contract: `submit` never blocks; it raises `QueueFull` when `max_queue` jobs already wait for the engine. The
engine thread takes up to the engine's `max_batch` jobs at once into its scheduler (engine/scheduler.py), which
decodes them together, and delivers events to each submitting event loop: ("text", (piece, tokens so far)) as text
arrives (with the tokens since the last piece and, when asked for, their log probabilities), then
("done", RequestOutput) or ("error", exception). A job whose `cancel` is set is skipped if it has not
started, and leaves the batch before the next engine step if it has, so an abandoned request frees its slot within
one step. A failed step fails the jobs it ran (the engine's fault, 5xx), not the engine thread. Reads of the
engine's counters (`call`) run on the engine thread between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from moestream.engine.stream import TextStream
from moestream.errors import RequestError
from moestream.sampling import SamplingParams

log = logging.getLogger("moestream.server")
IDLE_WAKE_S = 0.005  # how long an idle engine thread waits for a job before it runs the calls waiting for it


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    """A job refused or stopped because the server is stopping (503)."""


@dataclass
class Job:
    """One completion choice; its events are (index, kind, value), on a queue it may share with the other choices
    of its request."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    sent: int = 0  # tokens whose pieces were emitted

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, value))
        except RuntimeError:  # the event loop has closed: the server is shutting down
            self.cancel.set()


class EngineWorker:
    def __init__(self, llm, max_queue: int):
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.llm = llm
        self.max_queue = max_queue
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.active: list[tuple[Job, TextStream]] = []  # the jobs in the engine, with their streams
        self.calls: queue.Queue = queue.Queue()  # (fn, future) to run on the engine thread
        self.counts = dict(completed=0, cancelled=0, failed=0, rejected=0)
        self.busy_seconds = 0.0
        self.fault: str | None = None  # the engine's last own failure, until a request completes again
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="moestream-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, events: asyncio.Queue | None = None,
               index: int = 0) -> Job:
        if self.stopping:
            raise ShuttingDown
        job = Job(prompt_ids, params, asyncio.get_running_loop(), events or asyncio.Queue(), index)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise QueueFull from None
        return job

    def cancel_all(self) -> None:
        """Stop the running jobs before the next step and fail the waiting ones (the server is stopping)."""
        self.stopping = True
        for job, _ in list(self.active):
            job.cancel.set()
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

    def call(self, fn) -> Future:
        """Run `fn()` on the engine thread between two steps (reading the engine's counters while it steps would
        race with it); the future has its result."""
        future: Future = Future()
        self.calls.put((fn, future))
        if not self.thread.is_alive():  # not started, or stopped: nothing steps the engine
            self._run_calls()
        return future

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self.calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:
                    future.set_exception(e)

    def _loop(self) -> None:
        while self._admit():
            self._run_calls()
            if not self.active:
                continue
            tic = time.monotonic()
            try:
                self.llm.step()
            except Exception as e:  # no failure may take the engine thread down
                log.exception("generation failed")
                self.fault = f"{type(e).__name__}: {e}"
                for job, _ in self.active:
                    self.counts["failed"] += 1
                    job.emit("error", e)
                self.active = []
            self.busy_seconds += time.monotonic() - tic
            for job, stream in list(self.active):
                for piece in stream.pieces():
                    made = len(stream.tokens)
                    entries = stream.logprobs[job.sent: made] if job.params.logprobs is not None else None
                    job.emit("text", (piece, made, stream.tokens[job.sent: made], entries))
                    job.sent = made
                if stream.done:
                    self.active.remove((job, stream))
                    out = stream.output()
                    self.fault = None
                    self.counts["cancelled" if out.finish_reason == "cancelled" else "completed"] += 1
                    job.emit("done", out)

    def _admit(self) -> bool:
        """Move queued jobs into the engine while it has room, waiting for one when it has none to run; False
        when the worker is told to stop."""
        while len(self.active) < self.llm.max_batch:
            try:  # idle, it wakes now and then for the calls
                job = self.jobs.get(timeout=IDLE_WAKE_S) if not self.active else self.jobs.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                for _, stream in self.active:
                    stream.close()
                self._run_calls()
                return False
            if job.cancel.is_set():
                self.counts["cancelled"] += 1
                continue
            job.started_at = time.monotonic()
            stream = TextStream(self.llm, job.prompt_ids, job.params, cancelled=job.cancel.is_set)
            try:
                stream.start()
            except Exception as e:  # a request the engine refuses (4xx), or the engine's own fault
                if not isinstance(e, RequestError):
                    log.exception("the request could not start")
                    self.fault = f"{type(e).__name__}: {e}"
                self.counts["failed"] += 1
                job.emit("error", e)
                continue
            self.active.append((job, stream))
        return True
