"""The gateway's door to the queues, injected by whoever builds the app (workers/wsgi.py passes
workers.dispatch), so rollout_service never depends on the workers package."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import redis

Enqueue = Callable[[list[str], str], None]  # job ids, the stage they start at


class Enqueuer(Protocol):
    def enqueue_jobs(self, job_ids: Iterable[str], stage: str) -> None:
        """Start jobs at ``stage`` (``tasks.first_stage``)."""

    def submit_score(self, score_id: str) -> None:
        """Score the stored ``score-request`` of ``score_id`` on the eval queue."""

    def served_queues(self, client: redis.Redis) -> set[str]:
        """The queues a live worker consumes."""

    def announce_batch_member_done(self, job_id: str, batch_id: str) -> None:
        """A job of batch ``batch_id`` ('' none) ended: its batch decides its group."""
