"""Prometheus text exposition, computed from Redis on each scrape (every gateway process agrees)."""
from __future__ import annotations

import redis

from rollout_service.backends import BackendPool
from rollout_service.store import LIVE_JOBS

QUEUES = ("init", "run", "eval", "control")


def render(client: redis.Redis) -> str:
    lines: list[str] = []

    def gauge(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    gauge("rollout_queue_length", "Messages waiting in each Celery queue.",
          [(f'{{queue="{q}"}}', client.llen(q)) for q in QUEUES])
    gauge("rollout_live_jobs", "Jobs not yet in a terminal state.", [("", client.scard(LIVE_JOBS))])
    pool = BackendPool(client)
    backends = pool.list()
    for field, help_text in (("live_assignments", "Rollouts currently assigned to the backend."),
                             ("total_assignments", "Rollouts ever assigned to the backend."),
                             ("healthy", "1 if the backend passes its health probes."),
                             ("policy_version", "Policy version the backend serves.")):
        gauge(f"rollout_backend_{field}", help_text,
              [(f'{{backend="{b.id}",model="{b.model}"}}', float(getattr(b, field))) for b in backends])
    gauge("rollout_backends_paused", "1 while LLM calls are paused for a weight sync.",
          [("", float(pool.paused()))])
    return "\n".join(lines) + "\n"
