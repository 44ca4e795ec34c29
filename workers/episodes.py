"""How a run worker runs its episodes, apart from what an episode is: slots (as many episodes as
the worker's concurrency, the rest back to the queue), start gaps between the episodes of one
message, the call gate kept alive in a green worker, the first LLM call sent with the stage's
begin and handed to the episode, sandboxes started in the background, and the yield to live
episodes once one ends. ``EpisodeRunner.run`` takes the episode as a function of its job and its
``EpisodeStart``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from rollout_service.concurrency.autopipeline import AutoPipelineRedis
from rollout_service.concurrency.green import after_live_work, green_process, in_background
from rollout_service.runtime.llm import CALL_GATE
from rollout_service.sandbox.base import BackgroundStart, Sandbox
from rollout_service.schemas import BackendView
from rollout_service.settings import get_settings
from rollout_service.state.backends import AllBackendsDown, BackendPool, FirstCall
from rollout_service.state.store import BeginCall
from workers import celery_app, dispatch
from workers.stage import job_store

SLOT_WAIT_S = 0.1
END_YIELD_CAP_S = 0.05


class Slots:
    """How many jobs a process runs at once: its worker's --concurrency, however many jobs the
    messages its tasks receive carry. Celery counts a message as one task; while a task runs k
    jobs, the worker's prefetch is lowered by k - 1 (as Celery does for ETA tasks), so a full
    worker stops taking messages and leaves them in the queue for other workers."""

    def __init__(self) -> None:
        self.used = 0
        self._free = threading.Condition()

    @property
    def capacity(self) -> int:
        return celery_app.worker_slots or get_settings().run_concurrency

    def take(self, wanted: int, wait_s: float) -> int:
        """Up to ``wanted`` of the free slots, after waiting up to ``wait_s`` for one to free."""
        with self._free:
            self._free.wait_for(lambda: self.used < self.capacity, timeout=wait_s)
            granted = max(min(wanted, self.capacity - self.used), 0)
            self.used += granted
        if granted > 1 and celery_app.consumer_qos is not None:
            celery_app.consumer_qos.decrement_eventually(granted - 1)
        return granted

    def give_back(self, beyond_first: bool) -> None:
        """A job ended; ``beyond_first``: not the first job its task took (that one is the message's)."""
        with self._free:
            self.used -= 1
            self._free.notify()
        if beyond_first and celery_app.consumer_qos is not None:
            celery_app.consumer_qos.increment_eventually(1)


class EpisodeStart:
    """What the runner gives one episode: its backend pool, the first LLM call sent with the
    stage's begin (``begin_call``), a background start for its sandbox and the yield once it ends."""

    def __init__(self, job_id: str, pool: BackendPool, end_yield_cap_s: float) -> None:
        self.job_id, self.pool, self.end_yield_cap_s = job_id, pool, end_yield_cap_s
        self._first_call: list[FirstCall] = []  # made by the script that begins the stage

    def begin_call(self) -> dict[str, BeginCall]:
        """What the stage's begin also does for this job (``run_stage_jobs(calls=...)``)."""
        return {self.job_id: self.pool.first_call_with_begin(self.job_id, self._first_call)}

    def granted_backend(self) -> BackendView | None:
        """The backend the first call was granted, if it was sent and granted one (its answer is
        read once: the call itself uses it later)."""
        try:
            granted = self._first_call[0]()[0] if self._first_call else None
        except AllBackendsDown:  # the episode's first call waits for one to come back
            return None
        return granted if isinstance(granted, BackendView) else None

    def take_first_call(self) -> FirstCall | None:
        """The first call for the episode's LLM, which releases it with the job's backend if unused."""
        return self._first_call.pop() if self._first_call else None

    def boot(self, sandbox: Sandbox) -> BackgroundStart:
        """``sandbox`` starting in the background while the episode's first LLM call goes out."""
        return BackgroundStart(sandbox)

    def ended(self) -> None:
        """The episode ended: what follows (artifact, records) waits for the live episodes' turns."""
        after_live_work(self.end_yield_cap_s)

    def drop_unused(self) -> None:
        """The stage began but ended before its episode took the first call (e.g. past the deadline)."""
        if self._first_call:
            self.pool.drop_first_call(self.job_id, self._first_call.pop())


Episode = Callable[[str, EpisodeStart], None]


class EpisodeRunner:
    """Runs the episodes of a run task's jobs concurrently, as many as this process has free slots
    for; the rest go back to the queue for any run worker. (A message can arrive before the prefetch
    window has shrunk for the jobs already running: a full worker gives it back after ``slot_wait_s``.)"""

    def __init__(self, slot_wait_s: float = SLOT_WAIT_S, end_yield_cap_s: float = END_YIELD_CAP_S) -> None:
        self.slots = Slots()
        self.slot_wait_s, self.end_yield_cap_s = slot_wait_s, end_yield_cap_s

    def run(self, job_ids: Sequence[str], episode: Episode) -> None:
        taken = self.slots.take(len(job_ids), self.slot_wait_s)
        if taken < len(job_ids):
            dispatch.send_stage("run", job_ids[taken:])
        if green_process():
            client = job_store().redis
            CALL_GATE.keep(client, get_settings().call_gate_lease_s)
            if isinstance(client, AutoPipelineRedis):  # its round trips linger only while many episodes run
                many = get_settings().redis_batch_linger_min_episodes
                client.busy = lambda: self.slots.used >= many
        gap_s = get_settings().episode_start_gap_ms / 1000
        joins = []
        for n, job_id in enumerate(job_ids[:taken]):
            if n and gap_s > 0:
                time.sleep(gap_s)  # a green sleep: started together, their calls would answer together every turn
            joins.append(in_background(self._one, job_id, n > 0, episode, name=f"run-{job_id}"))
        for join in joins:
            join()

    def _one(self, job_id: str, beyond_first: bool, episode: Episode) -> None:
        start = EpisodeStart(job_id, BackendPool(job_store().redis), self.end_yield_cap_s)
        try:
            episode(job_id, start)
        finally:
            start.drop_unused()
            self.slots.give_back(beyond_first)
