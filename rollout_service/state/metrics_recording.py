"""Counters and histograms kept in Redis, so every gateway and worker process adds to the same
numbers. Each recording is ONE pipelined write: once per finished job and once per episode,
never per turn; a green worker gathers them for ``metrics_flush_s`` and writes them together, so
that many episodes ending at once do not each send their own commands while other episodes wait
on the same CPU for their next call. ``metrics.render`` turns them into Prometheus text.

``rollout:metrics:counters`` holds ``<name>|<labels>`` -> count; ``rollout:metrics:histograms``
holds ``<name>|<labels>|<le>`` -> observations in that bucket alone (made cumulative when
rendered), plus ``<name>|<labels>|sum`` and ``<name>|<labels>|count``.
"""

from __future__ import annotations

import atexit
import bisect
import functools
import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from rollout_service.concurrency.autopipeline import AutoPipelineRedis, SharedPipeline
from rollout_service.settings import get_settings
from rollout_service.state.views import stage_seconds

log = logging.getLogger(__name__)

COUNTERS_KEY = "rollout:metrics:counters"
HISTOGRAMS_KEY = "rollout:metrics:histograms"


@dataclass(frozen=True)
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]


_SECONDS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
HISTOGRAMS = {
    h.name: h
    for h in (
        Histogram(
            "rollout_stage_duration_seconds",
            "Time of a job in each stage (queued = all waits for a worker, summed), at job end.",
            _SECONDS,
        ),
        Histogram("rollout_llm_call_seconds", "Latency of one LLM call (a generation turn).", _SECONDS),
        Histogram(
            "rollout_tool_seconds",
            "Time from a turn's parsed tool calls to its observation (all tool calls of the turn).",
            _SECONDS,
        ),
        Histogram("rollout_sandbox_boot_seconds", "Sandbox start to its first answer.", _SECONDS),
    )
}
COUNTERS = {
    "rollout_jobs_finished": "Jobs that reached a terminal state, by status and finish_reason.",
    "rollout_stage_redeliveries": "Deliveries of a stage beyond the first (worker lost), counted at job end.",
}


def labels_text(labels: Mapping[str, str]) -> str:
    return _labels_text(tuple(labels.items()))


@functools.lru_cache(maxsize=1024)  # a handful of label sets, written at every episode's end
def _labels_text(items: tuple[tuple[str, Any], ...]) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return ",".join(f'{key}="{escape(str(value))}"' for key, value in items)


def bucket_of(histogram: Histogram, value: float) -> str:
    index = bisect.bisect_left(histogram.buckets, value)
    return _bucket_names(histogram.buckets)[index]


@functools.cache
def _bucket_names(buckets: tuple[float, ...]) -> tuple[str, ...]:
    return (*(repr(le) for le in buckets), "+Inf")


class Increments:
    """Metric increments gathered in memory, written as one HINCRBY (or HINCRBYFLOAT) per field:
    the jobs of a batch share buckets, so their recording is a handful of commands, not a dozen each."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.sums: defaultdict[str, float] = defaultdict(float)

    def observe(self, name: str, values: Iterable[float | None], labels: Mapping[str, str] | None = None) -> None:
        present = [float(v) for v in values if v is not None]
        if not present:
            return
        histogram, prefix = HISTOGRAMS[name], f"{name}|{labels_text(labels or {})}|"
        for value in present:
            self.counts[HISTOGRAMS_KEY, prefix + bucket_of(histogram, value)] += 1
        self.sums[prefix + "sum"] += sum(present)
        self.counts[HISTOGRAMS_KEY, prefix + "count"] += len(present)

    def count(self, name: str, labels: Mapping[str, str], amount: int = 1) -> None:
        assert name in COUNTERS, name
        self.counts[COUNTERS_KEY, f"{name}|{labels_text(labels)}"] += amount

    def add(self, other: Increments) -> None:
        self.counts.update(other.counts)
        for field, total in other.sums.items():
            self.sums[field] += total

    def write(self, client: redis.Redis, what: str) -> None:
        """Now, or in a green worker with the others of the next ``metrics_flush_s``."""
        if isinstance(client, AutoPipelineRedis):
            _gathered.add(self, client)
        else:
            self.write_now(client, what)

    def write_now(self, client: redis.Redis, what: str) -> None:
        if not self.counts:
            return
        pipe = client.pipeline(transaction=False)
        for (key, field), amount in self.counts.items():
            pipe.hincrby(key, field, amount)
        for field, total in self.sums.items():
            pipe.hincrbyfloat(HISTOGRAMS_KEY, field, total)
        _execute(pipe, what)


class _Gathered:
    """The increments of a green process not yet written, and the greenlet that writes them."""

    def __init__(self) -> None:
        self.increments = Increments()
        self.client: redis.Redis | None = None
        self._lock = threading.Lock()

    def add(self, increments: Increments, client: redis.Redis) -> None:
        import gevent

        with self._lock:
            self.increments.add(increments)
            scheduled, self.client = self.client is not None, client
        if not scheduled:
            gevent.spawn_later(get_settings().metrics_flush_s, self.flush)

    def flush(self) -> None:
        with self._lock:
            increments, client = self.increments, self.client
            self.increments, self.client = Increments(), None
        if client is not None:
            increments.write_now(client, "gathered")

    def flush_at_exit(self) -> None:
        """What is left when the worker stops, in a round trip of its own (no flusher greenlet runs now)."""
        client = self.client
        if client is not None:
            try:
                self.increments.write_now(redis.Redis(connection_pool=client.connection_pool), "gathered")
            except Exception:  # the hub may be gone: metrics are not worth a traceback at exit
                log.warning("could not write the last gathered metrics", exc_info=True)


_gathered = _Gathered()
atexit.register(_gathered.flush_at_exit)


def _execute(pipe: Any, what: str) -> None:
    try:
        if isinstance(pipe, SharedPipeline):  # nothing waits on a metric in a green worker
            pipe.fire()
        else:
            pipe.execute()
    except redis.RedisError:  # a lost metric must never fail a job
        log.warning("could not record %s metrics", what, exc_info=True)


def stage_durations(fields: Mapping[str, str]) -> dict[str, float]:
    """queued/init/run/eval seconds of a job hash, as ``JobStore.view`` reports its timings."""
    waits, spans = stage_seconds(fields)
    durations = {"queued": sum(waits.values()) if waits else None, **spans}
    return {stage: seconds for stage, seconds in durations.items() if seconds is not None}


def record_job_finished(client: redis.Redis, *jobs: Mapping[str, str]) -> None:
    """At jobs' terminal transitions, with their hashes: status, finish_reason, stage times,
    redeliveries (one round trip for all of them)."""
    increments = Increments()
    count_jobs_finished(increments, *jobs)
    increments.write(client, "job")


def count_jobs_finished(increments: Increments, *jobs: Mapping[str, str]) -> None:
    """What ``record_job_finished`` writes, added to ``increments`` (written later, with others)."""
    for fields in jobs:
        increments.count(
            "rollout_jobs_finished",
            {"status": fields.get("status") or "unknown", "finish_reason": fields.get("finish_reason") or "none"},
        )
        for stage, seconds in stage_durations(fields).items():
            increments.observe("rollout_stage_duration_seconds", [seconds], {"stage": stage})
        for stage in ("init", "run", "eval"):
            extra = int(fields.get(f"attempts_{stage}") or 0) - 1
            if extra > 0:
                increments.count("rollout_stage_redeliveries", {"stage": stage}, extra)


def record_episode(client: redis.Redis, trajectory: Any, sandbox_boot_s: float | None) -> None:
    """After an episode: every LLM call's and tool turn's latency from the trajectory, and the boot."""
    increments = Increments()
    turns = trajectory.turns
    increments.observe("rollout_llm_call_seconds", [t.latency_s for t in turns if t.kind == "generation"])
    increments.observe("rollout_tool_seconds", [t.latency_s for t in turns if t.kind == "observation"])
    increments.observe("rollout_sandbox_boot_seconds", [sandbox_boot_s])
    increments.write(client, "episode")
