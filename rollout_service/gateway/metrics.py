"""Prometheus text exposition, computed from Redis on each scrape (every gateway process agrees).

Counters and histograms are written by ``metrics_recording`` (one pipelined write per finished
job or episode); gauges are read here: queue depths, live jobs, sandboxes, backends.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, cast

import redis

from rollout_service.concurrency.broker import UNACKED_KEY, queue_keys, unacked_route
from rollout_service.sandbox.registry import EXPIRY_KEY
from rollout_service.state.backends import BackendPool
from rollout_service.state.connection import as_text, broker_client
from rollout_service.state.keys import LIVE_JOBS, PREFIX
from rollout_service.state.metrics_recording import COUNTERS, COUNTERS_KEY, HISTOGRAMS, HISTOGRAMS_KEY, labels_text

QUEUES = ("init", "run", "eval", "control")
# the status a job has while the message of its stage waits (once the stage starts, it moves on)
WAITING_STATUS = {"init": "queued", "run": "initializing", "eval": "running"}


class Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, labels: str, value: float) -> None:
        self.lines.append(f"{name}{{{labels}}} {float(value)}" if labels else f"{name} {float(value)}")

    def gauge(self, name: str, help_text: str, samples: Iterable[tuple[str, float]]) -> None:
        self.family(name, "gauge", help_text)
        for labels, value in samples:
            self.sample(name, labels, value)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def queue_depths(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """Per queue: (messages waiting in the kombu list, messages a worker reserved but has not
    started). With acks_late a started task stays in kombu's ``unacked`` hash too; for the job
    stages (init/run/eval) a reserved message counts as unstarted while its job still has the
    status it had before that stage (``WAITING_STATUS``). ``control`` tasks carry no job, so
    their reserved count also includes running ones (they take milliseconds)."""
    pipe = client.pipeline(transaction=False)
    for queue in QUEUES:
        for key in queue_keys(queue):
            pipe.llen(key)
    pipe.hvals(UNACKED_KEY)
    *lengths, unacked = pipe.execute()
    per_queue = len(queue_keys(QUEUES[0]))
    waiting = {q: sum(lengths[i * per_queue : (i + 1) * per_queue]) for i, q in enumerate(QUEUES)}
    reserved: dict[str, int] = defaultdict(int)
    job_stages: list[tuple[str, str]] = []
    for raw in unacked:
        queue, task_id = unacked_route(raw)
        stage = task_id.rpartition(".")[2] if task_id else ""
        if queue in WAITING_STATUS and stage == queue:
            job_stages.append((task_id.rpartition(".")[0], queue))
        elif queue in waiting:
            reserved[queue] += 1
    if job_stages:
        pipe = client.pipeline(transaction=False)
        for job_id, _ in job_stages:
            pipe.hget(f"{PREFIX}:job:{job_id}", "status")
        for (_, queue), status in zip(job_stages, pipe.execute()):
            if status is not None and as_text(status) == WAITING_STATUS[queue]:
                reserved[queue] += 1
    return {q: (waiting[q], reserved[q]) for q in QUEUES}


def _render_counters(out: Exposition, client: redis.Redis) -> None:
    by_name: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for field, raw in cast("dict[bytes, bytes]", client.hgetall(COUNTERS_KEY)).items():
        name, _, labels = as_text(field).partition("|")
        by_name[name].append((labels, float(raw)))
    for name, help_text in COUNTERS.items():
        out.family(f"{name}_total", "counter", help_text)
        for labels, value in sorted(by_name[name]):
            out.sample(f"{name}_total", labels, value)


def _render_histograms(out: Exposition, client: redis.Redis) -> None:
    series: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for field, value in cast("dict[bytes, bytes]", client.hgetall(HISTOGRAMS_KEY)).items():
        name, labels, part = as_text(field).split("|")
        series[(name, labels)][part] = float(value)
    for name, histogram in HISTOGRAMS.items():
        out.family(name, "histogram", histogram.help)
        for (series_name, labels), parts in sorted(series.items()):
            if series_name != name:
                continue
            cumulative = 0.0
            for le in [repr(b) for b in histogram.buckets] + ["+Inf"]:
                cumulative += parts.get(le, 0.0)
                out.sample(f"{name}_bucket", ",".join(filter(None, (labels, f'le="{le}"'))), cumulative)
            out.sample(f"{name}_sum", labels, parts.get("sum", 0.0))
            out.sample(f"{name}_count", labels, parts.get("count", 0.0))


def render(client: redis.Redis) -> str:
    out = Exposition()
    depths = queue_depths(broker_client(client))
    out.gauge(
        "rollout_queue_length",
        "Messages waiting in each Celery queue's list.",
        [(f'queue="{q}"', waiting) for q, (waiting, _) in depths.items()],
    )
    out.gauge(
        "rollout_queue_reserved_unstarted",
        "Messages a worker has reserved but not started (control: reserved, started or not).",
        [(f'queue="{q}"', reserved) for q, (_, reserved) in depths.items()],
    )
    out.gauge(
        "rollout_queue_depth",
        "Messages not yet started: waiting plus reserved-but-unstarted.",
        [(f'queue="{q}"', waiting + reserved) for q, (waiting, reserved) in depths.items()],
    )
    out.gauge("rollout_live_jobs", "Jobs not yet in a terminal state.", [("", cast(int, client.scard(LIVE_JOBS)))])
    out.gauge(
        "rollout_sandboxes_alive",
        "Sandboxes registered (started and not yet stopped or reaped).",
        [("", cast(int, client.zcard(EXPIRY_KEY)))],
    )
    out.gauge(
        "rollout_sandboxes_expired",
        "Registered sandboxes past their expiry, waiting for the reaper.",
        [("", cast(int, client.zcount(EXPIRY_KEY, "-inf", time.time())))],
    )
    _render_counters(out, client)
    _render_histograms(out, client)
    _render_backends(out, BackendPool(client))
    return out.text()


def _render_backends(out: Exposition, pool: BackendPool) -> None:
    backends: list[Any] = pool.list()

    def labels(b: Any) -> str:
        return labels_text({"backend": b.id, "model": b.model})

    for field, help_text in (
        ("live_assignments", "Rollouts currently assigned to the backend."),
        ("healthy", "1 if the backend passes its health probes."),
        ("policy_version", "Policy version the backend serves."),
    ):
        out.gauge(f"rollout_backend_{field}", help_text, [(labels(b), float(getattr(b, field))) for b in backends])
    out.family("rollout_backend_assignments_total", "counter", "Rollouts ever assigned to the backend.")
    for b in backends:
        out.sample("rollout_backend_assignments_total", labels(b), b.total_assignments)
    out.gauge(
        "rollout_backends_paused", "1 while LLM calls are paused for a weight sync.", [("", float(pool.paused()))]
    )
