"""A job's view of the inference pool: sticky backend, weight-sync gate, failover."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import threading
import time
from collections.abc import Callable

import redis

from rollout_service.concurrency.green import in_background
from rollout_service.errors import (
    BackendError,
    BackendTimeout,
    BackendUnreachable,
    ContextWindowExceeded,
    GenerationAborted,
    NoBackendAvailable,
    NotFound,
)
from rollout_service.runtime.agent import EpisodeInterrupted
from rollout_service.runtime.http_pool import Abort, Aborted
from rollout_service.runtime.inference import Generation, InferenceClient, make_client
from rollout_service.runtime.trajectory import TrajectoryBuilder
from rollout_service.schemas import BackendView, FinishReason, Sampling
from rollout_service.settings import get_settings
from rollout_service.state.backends import AllBackendsDown, BackendPool, FirstCall
from rollout_service.state.connection import as_text
from rollout_service.state.keys import CANCEL_CHANNEL
from rollout_service.state.store import EndCall, JobStore

OUTAGE_POLL_S = 1.0  # while every backend of a job's model is down, how often its call asks for one again


@functools.lru_cache(maxsize=256)
def client_for(kind: str, url: str, model: str) -> InferenceClient:
    return make_client(kind, url, model)


class CallGate:
    """A green run worker's lease to start its episodes' later LLM calls without a round trip
    ahead of each, and to carry their in-flight count: Redis counts the gate, not each call. A
    keeper renews it every third of the lease, telling Redis whether calls started under it are
    still in flight. A renewal refused by a weight-sync pause closes the gate here to new calls;
    Redis keeps it open (the pause counts it) until its calls have ended and the worker releases
    it. Here it counts as open until the renewal's send time plus three quarters of the lease,
    before Redis's own expiry (a worker that stops renewing). A call's answer counts only if the
    gate held in Redis from the call's start to its end: its epoch did not change (a renewal found
    the gate lapsed, or it was released) and the end came before the last renewal's three quarters."""

    def __init__(self) -> None:
        self.open_until = 0.0  # new calls may start under the gate until then
        self.held_until = 0.0  # calls of this epoch are covered by the gate in Redis until then
        self.epoch = 0
        self.inflight = 0
        self.version = 0
        self.owner = ""
        self._pool: BackendPool | None = None
        self._pid = 0
        self._closed = False

    def version_if_open(self) -> int | None:
        return self.version if time.monotonic() < self.open_until else None

    def begin(self) -> int:
        """A call starts under the open gate: its epoch, for ``end``."""
        self.inflight += 1
        return self.epoch

    def end(self, epoch: int) -> bool:
        """The call started in ``epoch`` ended: whether the gate held it all along. The last call of
        a gate a pause closed releases it."""
        self.inflight -= 1
        held = epoch == self.epoch and time.monotonic() < self.held_until
        if self.inflight == 0 and self.open_until == 0.0 and self._pool is not None:
            self._release()
        return held

    def keep(self, client: redis.Redis, lease_s: float) -> None:
        """Start this process's keeper (once per process)."""
        if self._pid != os.getpid() and lease_s > 0:
            self._pid, self.open_until, self.held_until, self.inflight = os.getpid(), 0.0, 0.0, 0
            self._closed = False
            self.owner = f"{socket.gethostname()}:{os.getpid()}"
            self._pool = BackendPool(client)
            threading.Thread(
                target=self._renew_forever, args=(self._pool, lease_s), name="call-gate", daemon=True
            ).start()

    def close(self) -> None:
        """Stop renewing and release the gate (its calls no longer count as held)."""
        self._closed, self.open_until = True, 0.0
        if self._pool is not None:
            self._release()

    def _release(self) -> None:
        self.epoch += 1
        with contextlib.suppress(Exception):
            self._pool.release_gate_soon(self.owner)  # type: ignore[union-attr]

    def _renew_forever(self, pool: BackendPool, lease_s: float) -> None:
        while not self._closed:
            sent, busy = time.monotonic(), self.inflight > 0
            try:
                version, held = pool.renew_busy_gate(self.owner, lease_s, busy)
            except Exception:  # a Redis blip: closed until a renewal gets through
                self.open_until = 0.0
            else:
                if not held:
                    self.epoch += 1
                    self.held_until = 0.0
                if version is not None:
                    self.version, self.open_until = version, sent + 0.75 * lease_s
                    self.held_until = self.open_until
                else:
                    self.open_until = 0.0
                    if held and busy:
                        self.held_until = sent + 0.75 * lease_s
                    if self.inflight == 0:
                        self._release()
            if self._closed:
                self._release()
            time.sleep(lease_s / 3)


CALL_GATE = CallGate()

# the indexes (from 1) of the job hashes among KEYS whose cancel flag is up
_CANCELLED = """
local flagged = {}
for i, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'cancel_requested') == '1' then flagged[#flagged + 1] = i end
end
return flagged
"""


class CancelWatcher:
    """Aborts the in-flight LLM calls of cancelled jobs: one loop per process listens to the cancel
    messages (``JobStore.request_cancel`` publishes each) and aborts the calls of that job at once
    (their connections closed: the wait ends, and the engine stops generating for a client that
    left). It also reads the cancel flags of every in-flight call's job, in one round trip, when it
    subscribes and every ``cancel_check_s`` after: a message lost with its connection is caught
    there. A call costs a dict entry, no round trip."""

    def __init__(self) -> None:
        self.calls: dict[str, set[Abort]] = {}
        self.recent: dict[str, float] = {}  # job keys whose cancel message came lately -> when
        self._pid = 0

    def watch(self, client: redis.Redis, job_key: str) -> Abort:
        if self._pid != os.getpid():
            self._start(client)
        abort = Abort()
        self.calls.setdefault(job_key, set()).add(abort)
        if job_key in self.recent:  # its message came between the call's start and now
            abort.abort()
        return abort

    def unwatch(self, abort: Abort, job_key: str) -> None:
        aborts = self.calls.get(job_key)
        if aborts is not None:
            aborts.discard(abort)
            if not aborts:
                del self.calls[job_key]

    def _start(self, client: redis.Redis) -> None:
        self._pid, self.calls, self.recent = os.getpid(), {}, {}
        interval_s = get_settings().cancel_check_s
        if interval_s > 0:
            in_background(
                self._watch_forever, client, client.register_script(_CANCELLED), interval_s, name="cancel-watcher"
            )

    def _watch_forever(self, client: redis.Redis, cancelled: Callable[..., list[int]], interval_s: float) -> None:
        while True:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CANCEL_CHANNEL)
                self._listen(pubsub, cancelled, interval_s)
            except Exception:  # a Redis blip: subscribe again, and read the flags again
                time.sleep(min(interval_s, 1.0))
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()

    def _listen(self, pubsub: redis.client.PubSub, cancelled: Callable[..., list[int]], interval_s: float) -> None:
        look_at = 0.0
        while True:
            now = time.monotonic()
            if now >= look_at:
                self._look(cancelled)
                look_at = now + interval_s
                self.recent = {key: at for key, at in self.recent.items() if at > now - interval_s}
            message = pubsub.get_message(timeout=max(look_at - now, 0.001))
            if message is not None and message["type"] == "message":
                job_key = JobStore.key(as_text(message["data"]))
                self.recent[job_key] = time.monotonic()
                for abort in list(self.calls.get(job_key, ())):
                    abort.abort()

    def _look(self, cancelled: Callable[..., list[int]]) -> None:
        job_keys = list(self.calls)
        if job_keys:
            for index in cancelled(keys=job_keys):
                for abort in list(self.calls.get(job_keys[int(index) - 1], ())):
                    abort.abort()


CANCELS = CancelWatcher()


def _recorded(
    record: TrajectoryBuilder,
    gen: Generation,
    backend_id: str,
    version: int,
    moved_from: str | None,
    ended_under: Callable[[], int | None] | None,
) -> list[int]:
    """``gen`` added to the episode's trajectory as the engine returned it; its token ids."""
    record.add_generation(
        gen.token_ids,
        gen.logprobs,
        backend_id=backend_id,
        policy_version=version,
        finish_reason=gen.finish_reason,
        latency_s=gen.latency_s,
        moved_from=moved_from,
        ended_under=ended_under,
    )
    return gen.token_ids


MAX_ABORTED_CALLS = 5  # one call dropped by this many engine aborts in a row fails the job


class PooledLLM:
    """Generates for one job: acquires its sticky backend, waits out pauses, moves off dead backends."""

    def __init__(
        self,
        pool: BackendPool,
        job_id: str,
        sampling: Sampling,
        call_timeout_s: float,
        stop_reason: Callable[[], FinishReason | None],
        deadline_at: float = math.inf,
        job_key: str = "",
        max_policy_lag: int | None = None,
        outage_wait_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.job_id = job_id
        self.job_key = job_key
        self.max_policy_lag = max_policy_lag
        self.sampling = sampling
        self.call_timeout_s = call_timeout_s
        self.deadline_at = deadline_at
        self.stop_reason = stop_reason
        self.outage_wait_s = get_settings().backend_outage_wait_s if outage_wait_s is None else outage_wait_s
        self.down_since: float | None = None  # when this call first found no backend to run on
        self.last_backend_id: str | None = None
        # BackendPool.first_call_soon's answer, if the run worker sent the first call's round trip early
        self.first_call: FirstCall | None = None
        self.sticky: BackendView | None = None  # the backend of the job's last call, granted the careful way

    def generate(self, prompt_ids: list[int], max_new_tokens: int, record: TrajectoryBuilder) -> list[int]:
        gate_version = CALL_GATE.version_if_open()
        if self.sticky is not None and self.first_call is None and gate_version is not None:
            ids = self._generate_under_gate(self.sticky, gate_version, prompt_ids, max_new_tokens, record)
            if ids is not None:
                return ids
        left: str | None = None  # the backend this call failed on first
        ended_under: Callable[[], int | None] | None = None
        aborted = 0
        while True:
            backend = self._start_call()  # waits out a weight-sync pause
            version = backend.policy_version
            try:
                if self._stale(record, version):
                    raise EpisodeInterrupted(FinishReason.stale)
                gen = self._call(backend, prompt_ids, max_new_tokens)
            except GenerationAborted:
                aborted += 1
                if aborted > MAX_ABORTED_CALLS:
                    raise
                continue
            except BackendUnreachable as exc:
                unreachable = exc
            else:
                break
            finally:
                ended_under = self.pool.end_counted_call(self.job_id)
            self._lost(backend, unreachable, again=left is not None)  # not counted in flight while it waits
            left = left or backend.id
        self.down_since = None
        moved_from = next((b for b in (left, self.last_backend_id) if b not in (None, backend.id)), None)
        self.last_backend_id, self.sticky = backend.id, backend
        return _recorded(record, gen, backend.id, version, moved_from, ended_under)

    def _generate_under_gate(
        self, backend: BackendView, version: int, prompt_ids: list[int], max_new_tokens: int, record: TrajectoryBuilder
    ) -> list[int] | None:
        """A later call sent at once to the job's backend while this worker's gate is open: no
        round trip ahead of it, the gate counts it and its checks ride the next shared one. None if
        the gate did not hold it all along (a stalled worker: the call may have met a weight sync),
        the job was moved meanwhile or its backend did not answer: the careful way makes the call again."""
        if self._stale(record, version):
            raise EpisodeInterrupted(FinishReason.stale)
        epoch = CALL_GATE.begin()
        checked = self.pool.check_call_soon(self.job_id, self.job_key)
        gen = None
        held = False
        try:
            gen = self._call(backend, prompt_ids, max_new_tokens)
        except (BackendUnreachable, GenerationAborted):
            pass
        finally:
            held = CALL_GATE.end(epoch)
        ended_under = self.pool.version_soon() if held and gen is not None else None
        status, assigned = checked()
        if status == "cancelled":
            raise EpisodeInterrupted(FinishReason.cancelled)
        if gen is None or ended_under is None or assigned != backend.id:
            self.sticky = None
            return None
        return _recorded(record, gen, backend.id, version, None, ended_under)

    def _call(self, backend: BackendView, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        """One call to ``backend``; a limit it hits ends the episode, an unreachable server raises."""
        remaining_s = self.deadline_at - time.time()
        if remaining_s <= 0:
            raise EpisodeInterrupted(FinishReason.deadline)
        abort = CANCELS.watch(self.pool.redis, self.job_key) if self.job_key else None
        try:
            return client_for(backend.kind, backend.url, backend.model).generate(
                prompt_ids, self.sampling, max_new_tokens, min(self.call_timeout_s, remaining_s), abort
            )
        except Aborted:  # the job was cancelled mid-call
            raise EpisodeInterrupted(FinishReason.cancelled) from None
        except BackendTimeout:
            if time.time() >= self.deadline_at:  # cut by the job's deadline, not a slow server
                raise EpisodeInterrupted(FinishReason.deadline) from None
            raise
        except ContextWindowExceeded:  # the server's context is full: a limit, like max_model_len
            raise EpisodeInterrupted(FinishReason.context_length) from None
        finally:
            if abort is not None:
                CANCELS.unwatch(abort, self.job_key)

    def release_with_end(self) -> EndCall:
        """The job's backend, released by the script that ends its stage (``StageContext.end_call``);
        a first call granted but never made is ended and undone now."""
        self._drop_first_call()
        return self.pool.release_with_end(self.job_id)

    def _drop_first_call(self) -> None:
        if self.first_call is not None:
            self.pool.drop_first_call(self.job_id, self.first_call)
            self.first_call = None

    def _start_call(self) -> BackendView:
        """The job's backend for this call, after one round trip that also checks the cancel flag
        and the weight-sync gate (waited out here), as is an outage of every backend of the model."""
        while True:
            if time.time() >= self.deadline_at:
                raise EpisodeInterrupted(FinishReason.deadline)
            granted: BackendView | str = "later"
            try:
                if self.first_call is not None:
                    answer, self.first_call = self.first_call, None
                    granted, _ = answer()
                if granted == "later":
                    granted = self.pool.start_call(self.job_id, self.sampling.model, self.job_key)
            except AllBackendsDown as down:
                self._wait_for_a_backend(down)
                continue
            if granted == "cancelled":
                raise EpisodeInterrupted(FinishReason.cancelled)
            if granted != "paused":
                return granted  # type: ignore[return-value]
            if reason := self.stop_reason():
                raise EpisodeInterrupted(reason)
            self.pool.wait_resumed(1.0, lambda: self.stop_reason() is not None)

    def _stale(self, record: TrajectoryBuilder, version: int) -> bool:
        """The policy moved on more than ``max_policy_lag`` versions since the episode's first call."""
        if self.max_policy_lag is None:
            return False
        versions = [t.policy_version for t in record.turns if t.policy_version is not None]
        return bool(versions) and version - min(versions) > self.max_policy_lag

    def _lost(self, dead: BackendView, exc: BackendError, again: bool) -> None:
        """``dead`` did not answer: mark it unhealthy (the pool moves the job, or the next start
        waits for a backend); ``again``: this call lost one before, so pause before the next try."""
        now = time.monotonic()
        self.down_since = self.down_since or now
        if now - self.down_since >= self.outage_wait_s:
            raise NoBackendAvailable(
                f"{exc}; no backend of model {dead.model!r} answered for "
                f"{now - self.down_since:.0f} s (ROLLOUT_BACKEND_OUTAGE_WAIT_S)"
            ) from exc
        try:
            self.pool.set_health(dead.id, False)
        except NotFound:
            pass  # removed meanwhile: the next start moves the job anyway
        if again:
            time.sleep(min(OUTAGE_POLL_S, max(self.deadline_at - time.time(), 0.0)))

    def _wait_for_a_backend(self, down: AllBackendsDown) -> None:
        """Every backend of the model is down (engines restarting): wait for one to come back, for
        at most ``outage_wait_s`` in a row and never past the job's deadline."""
        now = time.monotonic()
        self.down_since = self.down_since or now
        waited_s = now - self.down_since
        if waited_s >= self.outage_wait_s:
            raise NoBackendAvailable(
                f"{down}; none came back within {self.outage_wait_s:g} s (ROLLOUT_BACKEND_OUTAGE_WAIT_S)"
            ) from down
        time.sleep(max(min(OUTAGE_POLL_S, self.outage_wait_s - waited_s, self.deadline_at - time.time()), 0.0))
