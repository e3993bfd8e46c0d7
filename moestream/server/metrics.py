"""Prometheus metrics for one server: request counters and latencies kept here, plus the engine's expert
counters, the prefix cache and the queue, read on the engine thread between two steps (`EngineCollector.read`)
and served from that reading, so that a scrape never waits for the engine unless the reading is stale.

Each server gets its own registry (several apps can live in one process, as in the tests). Expert
metrics are labelled by precision and, for reads, by tier (gpu = pool hits, host, disk).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from moestream.engine.scheduler import STEP_BUCKETS

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)
PREFIX_CACHE_COUNTERS = (  # metric name, PrefixCache.stats() key, help
    ("hits", "hits", "requests that restored a cached prompt prefix"),
    ("misses", "misses", "requests that found no cached prefix"),
    ("skipped_prefill_tokens", "cached_tokens", "prompt tokens restored instead of prefilled"),
    ("evictions", "evictions", "snapshots evicted to stay within the budget"),
)


class ServerMetrics:
    def __init__(self, llm, worker):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moestream_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("moestream_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("moestream_generation_tokens", "tokens generated", registry=r)
        self.latency = Histogram("moestream_request_latency_seconds", "request time, arrival to last token",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("moestream_time_to_first_token_seconds", "arrival to first text",
                                     ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("moestream_queue_wait_seconds", "time a request waited for the engine",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.engine = EngineCollector(llm, worker)
        r.register(self.engine)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """The engine, prefix cache and queue as of the last `read` (on the engine thread, between two steps)."""

    def __init__(self, llm, worker):
        self.llm, self.worker = llm, worker
        self.reading: tuple[float, list] | None = None  # (when, the metric families)
        self.pending: Future | None = None

    def describe(self):
        return []  # collected lazily; nothing to check at registration

    def collect(self):
        return self.reading[1] if self.reading else []

    def age(self) -> float:
        return time.monotonic() - self.reading[0] if self.reading else float("inf")

    def request(self) -> Future:
        """A reading on the engine thread: the one asked for already, if it has not run yet."""
        if self.pending is None or self.pending.done():
            self.pending = self.worker.call(self.read)
        return self.pending

    def read(self) -> None:
        self.reading = time.monotonic(), list(self._families())

    def _families(self):
        totals = self.llm.provider.totals()  # not llm.stats(): every layer's counters copied, per scrape
        names = sorted({k for c in totals.values() for k, v in c.items() if isinstance(v, int | float)})
        for name in names:  # lookups, hits, misses, prefetches, read/wait seconds: whatever the engine counts
            m = CounterMetricFamily(f"moestream_expert_{name}", f"expert {name.replace('_', ' ')}",
                                    labels=["precision"])
            for precision, c in totals.items():
                m.add_metric([precision], c.get(name, 0))
            yield m
        records = CounterMetricFamily("moestream_expert_read_records", "expert records served, by tier",
                                      labels=["precision", "tier"])
        nbytes = CounterMetricFamily("moestream_expert_read_bytes", "expert bytes served, by tier",
                                     labels=["precision", "tier"])
        for precision, c in totals.items():
            for tier, t in c["reads"].items():
                records.add_metric([precision, tier], t["records"])
                nbytes.add_metric([precision, tier], t["bytes"])
        yield records
        yield nbytes
        cache = self.llm.prefix_cache.stats() if self.llm.prefix_cache else {}
        for name, key, help_text in PREFIX_CACHE_COUNTERS:
            yield CounterMetricFamily(f"moestream_prefix_cache_{name}", help_text, value=cache.get(key, 0))
        yield GaugeMetricFamily("moestream_prefix_cache_bytes", "bytes held by the prefix cache",
                                value=cache.get("bytes", 0))
        yield GaugeMetricFamily("moestream_prefix_cache_entries", "snapshots held", value=cache.get("entries", 0))
        spec = self.llm.spec_stats.as_dict()
        for name, value, help_text in (
                ("drafts_proposed", sum(spec["proposed"]), "speculative drafts verified"),
                ("drafts_accepted", sum(spec["accepted"]), "speculative drafts kept"),
                ("steps", spec["steps"], "decode steps of a speculating engine, verify steps included"),
                ("tokens", round(spec["tokens_per_step"] * spec["steps"]), "tokens those steps produced")):
            yield CounterMetricFamily(f"moestream_speculation_{name}", help_text, value=value)
        yield GaugeMetricFamily("moestream_queue_depth", "requests waiting for the engine",
                                value=self.worker.jobs.qsize())
        yield GaugeMetricFamily("moestream_requests_running", "requests (choices) the engine is generating",
                                value=len(self.worker.active))
        scheduler = self.llm.scheduler
        yield GaugeMetricFamily("moestream_sequences_waiting", "sequences waiting for a batch slot",
                                value=self.worker.jobs.qsize() + len(scheduler.waiting))
        yield GaugeMetricFamily("moestream_sequences_prefilling", "sequences whose prompt is being prefilled",
                                value=int(scheduler.prefilling is not None))
        yield GaugeMetricFamily("moestream_sequences_decoding", "sequences in the decode batch",
                                value=len(scheduler.running))
        yield GaugeMetricFamily("moestream_kv_rows_in_use", "KV positions the sequences in slots fill",
                                value=scheduler.rows_in_use())
        kv = self.llm.decoder.kv
        yield GaugeMetricFamily("moestream_kv_blocks_in_use", "paged KV cache blocks the sequences hold",
                                value=kv.used if kv is not None else 0)
        yield GaugeMetricFamily("moestream_kv_blocks", "paged KV cache blocks (grown as needed when unbounded)",
                                value=kv.blocks if kv is not None else 0)
        yield GaugeMetricFamily("moestream_kv_blocks_promised", "KV blocks promised to the sequences in slots",
                                value=scheduler.promised)
        steps = CounterMetricFamily("moestream_decode_steps", "decode steps, by how many sequences they batched",
                                    labels=["batch"])
        for rows, count in sorted(scheduler.batch_rows.items()):
            steps.add_metric([str(rows)], count)
        yield steps
        times = HistogramMetricFamily("moestream_engine_step_seconds", "engine steps' wall time, by whether they fed "
                                      "prompt tokens (the decoding sequences wait for those)", labels=["prompt"])
        for kind, t in scheduler.step_times.items():
            cumulative = list(itertools.accumulate(t.counts))
            times.add_metric(["yes" if kind == "prompt" else "no"],
                             [*zip(map(str, STEP_BUCKETS), cumulative), ("+Inf", cumulative[-1])], t.seconds)
        yield times
