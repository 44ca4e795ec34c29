"""BackendPool against a real Redis; probes against real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis

from rollout_service.errors import NoBackendAvailable, NotFound, ValidationError
from rollout_service.schemas import BackendSpec, BackendView
from rollout_service.state.backends import BackendPool, backend_id_for

MODEL = "tiny-model"


def spec(port: int, model: str = MODEL, tokenizer: str | None = None) -> BackendSpec:
    return BackendSpec(url=f"http://127.0.0.1:{port}", kind="vllm", model=model, tokenizer=tokenizer)


@pytest.fixture
def pool(redis_client: redis.Redis) -> BackendPool:
    return BackendPool(redis_client, prefix="t")


def register(pool: BackendPool, n: int, model: str = MODEL, first_port: int = 9001) -> list[str]:
    return [pool.register(spec(first_port + i, model)).id for i in range(n)]


def live(pool: BackendPool) -> dict[str, int]:
    return {view.id: view.live_assignments for view in pool.list()}


def assert_exact(pool: BackendPool, r: redis.Redis) -> None:
    """Every score equals the size of the backend's job set; every job key agrees with the sets."""
    owners: dict[str, str] = {}
    for view in pool.list():
        jobs = {j.decode() for j in r.smembers(f"t:backend:jobs:{view.id}")}
        assert view.live_assignments == len(jobs), view
        for job in jobs:
            assert job not in owners, f"{job} held by {owners[job]} and {view.id}"
            owners[job] = view.id
            assert pool.backend_of(job) == view.id


# registry


def test_register_is_idempotent_per_url_and_defaults_tokenizer(pool: BackendPool) -> None:
    view = pool.register(spec(9001))
    assert view.id == backend_id_for("http://127.0.0.1:9001/")
    assert (view.tokenizer, view.healthy, view.live_assignments, view.total_assignments) == (MODEL, True, 0, 0)
    pool.acquire("job-1", None)
    again = pool.register(spec(9001, tokenizer="/models/tok"))
    assert again.id == view.id and again.tokenizer == "/models/tok"
    assert (again.live_assignments, again.total_assignments) == (1, 1)
    assert len(pool.list()) == 1 and pool.models() == [MODEL]


def test_reregistering_under_another_model_moves_it_between_pools(pool: BackendPool) -> None:
    backend = pool.register(spec(9001, "a")).id
    pool.register(spec(9002, "a"))
    pool.register(spec(9001, "b"))
    assert pool.models() == ["a", "b"]
    assert pool.acquire("j", "b").id == backend
    pool.register(spec(9001, "a"))
    assert pool.models() == ["a"]


def test_get_and_remove_unknown_backend_say_where_to_look(pool: BackendPool) -> None:
    for call in (pool.get, pool.remove, lambda i: pool.set_health(i, False)):
        with pytest.raises(NotFound, match="GET /v1/backends"):
            call("be-nope")


# acquire / release


def test_same_job_sticks_to_its_backend_until_release(pool: BackendPool) -> None:
    register(pool, 3)
    first = pool.acquire("job", MODEL)
    for _ in range(5):
        assert pool.acquire("job", None).id == first.id
    assert pool.get(first.id).live_assignments == 1
    assert pool.get(first.id).total_assignments == 1
    pool.release("job")
    assert pool.backend_of("job") is None
    assert set(live(pool).values()) == {0}


def test_acquire_picks_the_least_loaded_backend(pool: BackendPool) -> None:
    ids = register(pool, 4)
    for k in range(8):
        pool.acquire(f"j{k}", None)
    assert sorted(live(pool).values()) == [2, 2, 2, 2]
    for k in (0, 4):  # j0 and j4 hold the same (lowest id) backend: ties break deterministically
        pool.release(f"j{k}")
    emptied = min(ids)
    assert live(pool)[emptied] == 0
    assert pool.acquire("new-1", None).id == emptied
    assert pool.acquire("new-2", None).id == emptied
    assert sorted(live(pool).values()) == [2, 2, 2, 2]


def test_unhealthy_backends_are_skipped(pool: BackendPool) -> None:
    a, b = register(pool, 2)
    pool.set_health(a, False)
    assert {pool.acquire(f"j{k}", None).id for k in range(4)} == {b}
    assert live(pool) == {a: 0, b: 4}
    pool.set_health(a, True)
    assert pool.acquire("j9", None).id == a


def test_release_twice_is_a_no_op(pool: BackendPool, redis_client: redis.Redis) -> None:
    a, b = register(pool, 2)
    pool.acquire("j1", None)
    pool.acquire("j2", None)
    pool.release("j1")
    pool.release("j1")
    pool.release("never-acquired")
    assert sorted(live(pool).values()) == [0, 1]
    assert_exact(pool, redis_client)


def test_remove_moves_its_jobs_on_their_next_acquire(pool: BackendPool, redis_client: redis.Redis) -> None:
    a, b = register(pool, 2)
    on_a = [job for job in (f"j{k}" for k in range(4)) if pool.acquire(job, None).id == a]
    assert len(on_a) == 2
    pool.remove(a)
    with pytest.raises(NotFound):
        pool.get(a)
    assert [view.id for view in pool.list()] == [b]
    for job in on_a:
        pool.release(job)  # no-op: its assignment went with the backend
        assert pool.acquire(job, None).id == b
    assert live(pool) == {b: 4}
    assert_exact(pool, redis_client)
    pool.remove(b)
    assert pool.models() == []
    with pytest.raises(NoBackendAvailable, match="POST /v1/backends"):
        pool.acquire("j9", None)


def test_move_off_a_dead_backend_keeps_counts_exact(pool: BackendPool, redis_client: redis.Redis) -> None:
    ids = register(pool, 3)
    for k in range(9):
        pool.acquire(f"j{k}", None)
    dead = pool.backend_of("j0")
    victims = [f"j{k}" for k in range(9) if pool.backend_of(f"j{k}") == dead]
    for job in victims:
        moved = pool.move(job, dead)
        assert moved.id != dead
        assert pool.move(job, dead).id == moved.id  # a second mover sees the job already moved
    assert not pool.get(dead).healthy
    counts = live(pool)
    assert counts[dead] == 0 and sum(counts.values()) == 9
    assert sorted(counts[i] for i in ids if i != dead) == [4, 5]
    assert pool.get(dead).total_assignments == 3
    assert_exact(pool, redis_client)
    for k in range(9):
        pool.release(f"j{k}")
    assert set(live(pool).values()) == {0}


def test_reconcile_repairs_counts_leaked_by_dead_workers(pool: BackendPool, redis_client: redis.Redis) -> None:
    register(pool, 2)
    for k in range(6):
        pool.acquire(f"j{k}", None)
    pool.begin_call("j4")
    # damage the heap the way a torn write or a manual edit would
    for view in pool.list():
        redis_client.zadd(f"t:backend:heap:{MODEL}", {view.id: 17})
    assert pool.reconcile({"j0", "j1"}) == 4  # j2..j5 belonged to workers that died
    assert sum(live(pool).values()) == 2
    assert_exact(pool, redis_client)
    assert pool.inflight_calls() == 0
    for job in ("j2", "j3", "j4", "j5"):
        assert pool.backend_of(job) is None
    assert pool.reconcile({"j0", "j1"}) == 0


def test_model_errors_list_what_is_available(pool: BackendPool) -> None:
    with pytest.raises(NoBackendAvailable, match="no inference backend is registered"):
        pool.acquire("j", None)
    register(pool, 1, "alpha", 9001)
    register(pool, 1, "beta", 9002)
    with pytest.raises(ValidationError, match="alpha, beta.*sampling.model"):
        pool.acquire("j", None)
    with pytest.raises(ValidationError, match="'gamma'.*served models: alpha, beta"):
        pool.acquire("j", "gamma")
    assert pool.acquire("j", "beta").model == "beta"


def test_none_healthy_names_the_failing_servers(pool: BackendPool) -> None:
    for backend in register(pool, 2):
        pool.set_health(backend, False)
    with pytest.raises(NoBackendAvailable, match=r"all 2 registered \(http://127.0.0.1:900[12], "):
        pool.acquire("j", MODEL)
    assert set(live(pool).values()) == {0}


def test_concurrent_acquire_release_leaves_every_score_at_zero(
    pool: BackendPool, redis_url: str, redis_client: redis.Redis
) -> None:
    """8 threads x 500 cycles. Threads work in pairs on the same job ids, as a redelivered task
    running alongside the original would: both acquire concurrently, both release."""
    ids = register(pool, 4)
    threads, cycles = 8, 500
    errors: list[str] = []
    done = threading.Event()
    barriers = [threading.Barrier(2) for _ in range(threads // 2)]
    got: dict[tuple[str, int], str] = {}

    def worker(t: int) -> None:
        mine = BackendPool(redis.Redis.from_url(redis_url), prefix="t")
        pair = barriers[t // 2]
        for k in range(cycles):
            job = f"pair{t // 2}-{k}"
            pair.wait()
            backend = mine.acquire(job, None).id
            got[job, t % 2] = backend
            if mine.acquire(job, MODEL).id != backend:
                errors.append(f"{job} was not sticky")
            pair.wait()
            if got[job, 0] != got[job, 1]:
                errors.append(f"{job} got {got[job, 0]} and {got[job, 1]}")
            holders = [i for i in ids if mine.redis.sismember(f"t:backend:jobs:{i}", job)]
            if holders != [backend]:
                errors.append(f"{job} held by {holders}, acquired {backend}")
            pair.wait()
            mine.release(job)  # both twins release: the second is a no-op
            if k % 7 == 0:
                mine.release(job)  # a retried release

    def inspector() -> None:
        """Snapshots of all job sets, atomically: no job may ever be in two of them."""
        while not done.is_set():
            with redis_client.pipeline(transaction=True) as pipe:
                for i in ids:
                    pipe.smembers(f"t:backend:jobs:{i}")
                    pipe.zscore(f"t:backend:heap:{MODEL}", i)
                replies = pipe.execute()
            sets, scores = replies[0::2], replies[1::2]
            seen = [job for members in sets for job in members]
            if len(seen) != len(set(seen)):
                errors.append(f"a job held two backends: {sets}")
            if len(seen) > threads // 2:
                errors.append(f"{len(seen)} live assignments for {threads // 2} jobs in flight")
            if [len(members) for members in sets] != [int(score) for score in scores]:
                errors.append(f"scores {scores} disagree with job sets {sets}")

    watcher = threading.Thread(target=inspector)
    watcher.start()
    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    watcher.join()
    assert errors == []
    views = pool.list()
    assert [view.live_assignments for view in views] == [0, 0, 0, 0]
    assert sum(view.total_assignments for view in views) == threads // 2 * cycles
    assert all(view.total_assignments > 0 for view in views)
    assert redis_client.zrange(f"t:backend:heap:{MODEL}", 0, -1, withscores=True) == [
        (i.encode(), 0.0) for i in sorted(ids)
    ]
    assert redis_client.keys("t:backend:job:*") == []


def test_concurrent_moves_keep_counts_exact(pool: BackendPool, redis_url: str, redis_client: redis.Redis) -> None:
    ids = register(pool, 3)
    jobs = [f"j{k}" for k in range(60)]
    for job in jobs:
        pool.acquire(job, None)
    dead = ids[0]

    def mover(chunk: list[str]) -> None:
        mine = BackendPool(redis.Redis.from_url(redis_url), prefix="t")
        for job in chunk:
            mine.move(job, dead)
            mine.move(job, dead)

    workers = [threading.Thread(target=mover, args=(jobs[t::3] * 2,)) for t in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    counts = live(pool)
    assert counts[dead] == 0 and sum(counts.values()) == 60
    assert_exact(pool, redis_client)


# health probes against real servers


class HealthServer:
    def __init__(self) -> None:
        self.status = 200
        self.posted: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                code = owner.status if self.path == "/health" else 404
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.posted.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[list[HealthServer]]:
    started = [HealthServer(), HealthServer()]
    yield started
    for server in started:
        try:
            server.stop()
        except OSError:
            pass


def test_probe_needs_two_failures_to_mark_unhealthy_and_one_success_to_recover(
    pool: BackendPool, servers: list[HealthServer]
) -> None:
    up, flaky = (pool.register(spec(s.port)).id for s in servers)
    assert pool.probe(timeout_s=1.0) == {up: True, flaky: True}
    servers[1].status = 503
    assert pool.probe(timeout_s=1.0) == {up: True, flaky: True}
    assert pool.probe(timeout_s=1.0) == {up: True, flaky: False}
    assert not pool.get(flaky).healthy
    servers[1].status = 200
    assert pool.probe(timeout_s=1.0) == {up: True, flaky: True}


def test_probe_rounds_share_one_http_client(
    pool: BackendPool, servers: list[HealthServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making an httpx client costs 20-60 ms of CPU; the control worker probes every few seconds."""
    import httpx

    from rollout_service.state.backends import engines

    made, real_client = [], httpx.Client
    monkeypatch.setattr(engines, "_health_clients", {})
    monkeypatch.setattr(httpx, "Client", lambda **kw: made.append(kw) or real_client(**kw))
    up = pool.register(spec(servers[0].port)).id
    for _ in range(3):
        assert pool.probe(timeout_s=1.0) == {up: True}
    assert len(made) == 1
    servers[0].stop()
    assert pool.probe(timeout_s=0.5) == {up: True} and pool.probe(timeout_s=0.5) == {up: False}


def test_a_killed_server_is_probed_out_and_its_jobs_finish_on_the_survivor(
    pool: BackendPool, servers: list[HealthServer], redis_client: redis.Redis
) -> None:
    survivor, victim = (pool.register(spec(s.port)).id for s in servers)
    jobs = [f"j{k}" for k in range(6)]
    for job in jobs:
        pool.acquire(job, None)
    assert live(pool) == {survivor: 3, victim: 3}
    servers[1].stop()  # connection refused from now on
    pool.probe(timeout_s=0.5)
    assert pool.get(victim).healthy  # one miss is not enough
    assert pool.probe(timeout_s=0.5) == {survivor: True, victim: False}
    assert {pool.acquire(job, None).id for job in jobs} == {survivor}
    assert live(pool) == {survivor: 6, victim: 0}
    assert_exact(pool, redis_client)


def test_probe_of_a_server_that_hangs_times_out(pool: BackendPool) -> None:
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts connections, never answers
    try:
        backend = pool.register(spec(listener.getsockname()[1])).id
        started = time.monotonic()
        pool.probe(timeout_s=0.3)
        assert pool.probe(timeout_s=0.3) == {backend: False}
        assert time.monotonic() - started < 3
    finally:
        listener.close()


# weight sync


def test_pause_blocks_new_calls_and_resume_stamps_the_new_version(pool: BackendPool) -> None:
    assert (pool.policy_version(), pool.paused()) == (0, False)
    assert pool.begin_call("running") == 0
    pool.pause(60)
    assert pool.paused()
    assert pool.begin_call("j") is None
    assert pool.inflight_calls() == 1  # the running call is allowed to finish
    pool.end_call("running")
    assert pool.inflight_calls() == 0
    assert pool.resume() == 1
    assert pool.begin_call("j") == 1
    pool.pause(60)
    assert pool.resume(7) == 7 and pool.policy_version() == 7
    assert pool.begin_call("j") == 7
    assert pool.inflight_calls() == 2
    pool.end_call("j")
    pool.end_call("j")
    pool.end_call("j")  # an extra end never goes negative
    assert pool.inflight_calls() == 0
    with pytest.raises(ValidationError, match="below the current 7"):
        pool.resume(3)
    assert pool.policy_version() == 7
    view = pool.register(spec(9001))
    assert view.policy_version == 7


def test_wait_resumed_wakes_on_resume_and_honours_stop_and_timeout(pool: BackendPool) -> None:
    assert pool.wait_resumed(0.1, lambda: False)
    pool.pause(60)
    started = time.monotonic()
    assert not pool.wait_resumed(0.3, lambda: False)
    assert 0.25 < time.monotonic() - started < 2
    assert not pool.wait_resumed(5.0, lambda: True)

    timer = threading.Timer(0.2, pool.resume, args=(4,))
    timer.start()
    started = time.monotonic()
    assert pool.wait_resumed(5.0, lambda: False)
    assert time.monotonic() - started < 1.0
    assert pool.begin_call("j") == 4


def test_no_call_starts_while_paused_under_concurrency(pool: BackendPool, redis_url: str) -> None:
    """Callers loop begin_call/end_call; once pause() returns no begin_call succeeds until resume."""
    stop = threading.Event()
    stamps: list[tuple[float, float, int]] = []  # sent, answered, version

    def caller(t: int) -> None:
        mine = BackendPool(redis.Redis.from_url(redis_url), prefix="t")
        while not stop.is_set():
            if not mine.wait_resumed(5.0, stop.is_set):
                continue
            sent = time.monotonic()
            version = mine.begin_call(f"c{t}")
            if version is not None:
                stamps.append((sent, time.monotonic(), version))
                mine.end_call(f"c{t}")

    workers = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for w in workers:
        w.start()
    time.sleep(0.1)
    pool.pause(60)
    paused_at = time.monotonic()
    time.sleep(0.2)
    resuming_at = time.monotonic()
    pool.resume(5)
    resumed_at = time.monotonic()
    time.sleep(0.1)
    stop.set()
    for w in workers:
        w.join()
    assert pool.inflight_calls() == 0
    assert not [s for s in stamps if paused_at < s[0] and s[1] < resuming_at]
    assert {v for sent, answered, v in stamps if answered < paused_at} == {0}
    assert {v for sent, answered, v in stamps if sent > resumed_at} == {5}


def test_a_first_call_sent_with_the_stage_begin_counts_like_start_call_and_an_unused_one_is_undone(
    pool: BackendPool, redis_client: redis.Redis
) -> None:
    """The run worker sends a job's first start_call with its stage's begin, before it knows the job:
    only a job whose init recorded a first-call model gets one; one the episode does not use is
    ended, and its assignment released only if this call made it."""
    first, second = register(pool, 2)
    job_key = "t:job:j1"
    assert pool.first_call_soon("j1", job_key)() == ("later", False)  # init recorded nothing: start_call decides
    assert pool.inflight_calls() == 0 and pool.backend_of("j1") is None

    redis_client.hset(job_key, "first_call_model", MODEL)
    answer = pool.first_call_soon("j1", job_key)
    granted, assigned = answer()
    assert granted.id in (first, second) and assigned
    assert pool.inflight_calls() == 1 and live(pool)[granted.id] == 1
    pool.drop_first_call("j1", answer)
    assert pool.inflight_calls() == 0 and pool.backend_of("j1") is None and sum(live(pool).values()) == 0

    held = pool.acquire("j1", MODEL)  # another delivery holds the job and its backend
    answer = pool.first_call_soon("j1", job_key)
    assert answer() == (held, False)
    pool.drop_first_call("j1", answer)
    assert pool.inflight_calls() == 0 and pool.backend_of("j1") == held.id and live(pool)[held.id] == 1
    assert_exact(pool, redis_client)

    pool.pause(60)
    assert pool.first_call_soon("j1", job_key)() == ("paused", False)
    pool.resume()
    redis_client.hset(job_key, "cancel_requested", 1)
    assert pool.first_call_soon("j1", job_key)() == ("cancelled", False)
    assert pool.inflight_calls() == 0


def test_a_call_gate_is_refused_while_paused_expires_unless_renewed_and_can_be_released(pool: BackendPool) -> None:
    assert pool.renew_gate("worker-a", 0.2) == 0 and pool.renew_gate("worker-b", 5.0) == 0
    assert pool.open_gates() == 2
    time.sleep(0.3)
    assert pool.open_gates() == 1  # a's lapsed: a worker that stops renewing stops counting
    pool.pause(5.0)
    assert pool.renew_gate("worker-b", 5.0) is None and pool.open_gates() == 1  # refused, not removed
    pool.release_gate("worker-b")
    assert pool.open_gates() == 0
    assert pool.resume(7) == 7 and pool.renew_gate("worker-b", 5.0) == 7


def test_a_busy_gate_stays_open_through_a_pause_until_released_and_a_lapsed_one_is_not_opened_again(
    pool: BackendPool,
) -> None:
    assert pool.renew_busy_gate("worker-a", 1.0, True) == (0, False)  # a new gate: it held nothing before
    assert pool.renew_busy_gate("worker-a", 1.0, True) == (0, True)
    pool.pause(30)
    assert pool.renew_busy_gate("worker-a", 1.0, True) == (None, True)  # refused, kept open for its calls
    time.sleep(0.6)
    assert pool.renew_busy_gate("worker-a", 1.0, True) == (None, True)
    time.sleep(0.6)
    assert pool.open_gates() == 1  # past the lease of the refused renewal: its calls still count
    assert pool.renew_busy_gate("worker-a", 1.0, False) == (None, True)  # idle: not kept
    time.sleep(1.1)
    assert pool.open_gates() == 0
    assert pool.renew_busy_gate("worker-a", 1.0, True) == (None, False)  # lapsed: not opened while paused
    assert pool.open_gates() == 0
    pool.resume()
    assert pool.renew_busy_gate("worker-a", 1.0, True) == (1, False)
    pool.release_gate_soon("worker-a")
    assert pool.open_gates() == 0


def test_a_call_under_a_gate_checks_the_cancel_flag_and_the_assignment_without_a_count(
    pool: BackendPool, redis_client: redis.Redis
) -> None:
    backend = pool.register(BackendSpec(url="http://gated:1", kind="vllm", model="m"))
    pool.acquire("job-1", "m")
    job_key = "rollout:job:job-1"
    redis_client.hset(job_key, "cancel_requested", "0")
    assert pool.check_call_soon("job-1", job_key)() == ("ok", backend.id)
    assert pool.inflight_calls() == 0
    redis_client.hset(job_key, "cancel_requested", "1")
    assert pool.check_call_soon("job-1", job_key)() == ("cancelled", backend.id)
    pool.release("job-1")
    assert pool.check_call_soon("job-1", job_key)() == ("cancelled", "")
    assert pool.version_soon()() == 0


def test_a_worker_gate_counts_its_calls_through_a_pause_and_a_call_it_did_not_hold_does_not_count(
    pool: BackendPool, redis_client: redis.Redis
) -> None:
    from rollout_service.runtime.llm import CallGate

    pool = BackendPool(redis_client)  # the prefix the run workers' gates use
    gate = CallGate()
    gate.keep(redis_client, 0.6)
    try:
        wait_until(lambda: gate.version_if_open() == 0)
        assert pool.open_gates() == 1
        held = gate.begin()
        pool.pause(30)
        wait_until(lambda: gate.version_if_open() is None)  # closed to new calls at its next renewal
        time.sleep(1.0)  # past the lease: the pause still counts the gate, a call runs under it
        assert pool.open_gates() == 1
        assert gate.end(held)  # held all along; the last call releases the gate
        wait_until(lambda: pool.open_gates() == 0)
        pool.resume()
        wait_until(lambda: gate.version_if_open() == 1)
        lapsed = gate.begin()
        redis_client.zrem("rollout:backend:gates", gate.owner)  # as if the worker had stalled past its lease
        time.sleep(0.5)  # its next renewal finds the gate lapsed
        assert not gate.end(lapsed)
        assert gate.version_if_open() == 1 and pool.open_gates() == 1  # a new gate for the calls after
    finally:
        gate.close()
    wait_until(lambda: pool.open_gates() == 0)


def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# registration through the API


def test_registering_a_backend_whose_tokenizer_cannot_be_loaded_offline_is_a_400_naming_it(service, scripted_server):
    import httpx

    url = scripted_server({"episodes": []})
    started = time.monotonic()
    named = httpx.post(
        f"{service.url}/v1/backends", json={"url": url, "kind": "vllm", "model": "m", "tokenizer": "tiny"}
    )
    defaulted = httpx.post(f"{service.url}/v1/backends", json={"url": url, "kind": "vllm", "model": "no-such-model"})
    assert time.monotonic() - started < 5
    for answer, name in ((named, "'tiny'"), (defaulted, "'no-such-model'")):
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "`tokenizer`" in message and name in message and "Hugging Face cache" in message
    assert "defaults to `model`" in defaulted.json()["error"]["message"]
    listed = httpx.get(f"{service.url}/v1/backends").json()["backends"]
    assert all(b["url"] != url for b in listed)


def test_a_new_backend_is_healthy_only_if_it_answers_its_health_probe_at_registration(
    client, scripted_server, tiny_tokenizer_dir
):
    from rollout_service.devtools.redis_server import free_port

    answering = client.add_backend(
        scripted_server({"episodes": []}), "vllm", "probed", tokenizer=str(tiny_tokenizer_dir)
    )
    silent = client.add_backend(f"http://127.0.0.1:{free_port()}", "vllm", "probed", tokenizer=str(tiny_tokenizer_dir))
    try:
        assert answering.healthy and not silent.healthy
        assert {b.id: b.healthy for b in client.backends() if b.model == "probed"} == {
            answering.id: True,
            silent.id: False,
        }
    finally:
        client.remove_backend(answering.id)
        client.remove_backend(silent.id)


# the service as the control plane of its engines


def test_weights_loaded_moves_the_version_and_a_resume_in_the_same_pause_keeps_it(pool: BackendPool) -> None:
    assert pool.weights_loaded() == 1  # not paused: the version moves at once, the next resume bumps as usual
    pool.pause(60)
    assert pool.weights_loaded(5) == 5 and pool.paused()
    assert pool.resume(lift=False) == 5 and pool.paused()  # versioned first, the engines resume, then lifted
    assert pool.resume(5) == 5 and not pool.paused()
    pool.pause(60)
    assert pool.resume() == 6
    with pytest.raises(ValidationError, match="below the current 6"):
        pool.weights_loaded(2)
    with pytest.raises(ValidationError, match="below the current 6"):
        pool.check_version(2)


def test_a_call_that_a_sync_spanned_records_the_version_it_ended_under(pool: BackendPool) -> None:
    from rollout_service.runtime.trajectory import TrajectoryBuilder
    from rollout_service.schemas import FinishReason

    record = TrajectoryBuilder([1, 2], [])
    assert pool.begin_call("frozen") == 0 and pool.begin_call("quick") == 0
    record.add_generation(
        [3],
        [-0.1],
        backend_id="b",
        policy_version=0,
        finish_reason="stop",
        latency_s=0.1,
        ended_under=pool.end_call("quick"),
    )
    pool.pause(60)  # keep mode: the engine holds "frozen" while the weights change
    pool.weights_loaded(4)
    pool.resume(4)
    record.add_generation(
        [4],
        [-0.2],
        backend_id="b",
        policy_version=0,
        finish_reason="stop",
        latency_s=2.0,
        ended_under=pool.end_call("frozen"),
    )
    turns = record.build(FinishReason.finished).turns
    assert [(t.policy_version, t.resumed_under) for t in turns] == [(0, None), (0, 4)]
    assert pool.inflight_calls() == 0


def _is_paused(url: str) -> bool:
    import httpx

    return httpx.get(f"{url}/is_paused", timeout=5).json()["is_paused"]


def test_pause_and_resume_reach_every_engine_and_report_each(service, client, scripted_server, tiny_tokenizer_dir):
    from rollout_service.devtools.redis_server import free_port

    urls = [scripted_server({"episodes": []}) for _ in range(2)]
    backends = [client.add_backend(url, "reference", "controlled", tokenizer=str(tiny_tokenizer_dir)) for url in urls]
    dead = client.add_backend(
        f"http://127.0.0.1:{free_port()}", "vllm", "controlled", tokenizer=str(tiny_tokenizer_dir)
    )
    try:
        for mode in ("keep", "wait"):
            paused = client.pause(mode=mode, ttl_s=60)
            engines = {e["backend_id"]: e for e in paused["engines"]}
            assert paused["paused"] and paused["mode"] == mode
            assert all(engines[b.id]["ok"] for b in backends) and all(_is_paused(url) for url in urls)
            assert not engines[dead.id]["ok"] and "/pause failed" in engines[dead.id]["error"]
            resumed = client.resume()
            assert not resumed["paused"] and not any(_is_paused(url) for url in urls)
            assert all(e["ok"] for e in resumed["engines"] if e["backend_id"] != dead.id)
        aborting = client.pause(mode="abort", ttl_s=60)  # the reference server cannot drop a generation
        assert aborting["paused"]
        assert all("not supported" in e["error"] for e in aborting["engines"] if e["backend_id"] != dead.id)
        client.resume()
        import httpx

        bad = httpx.post(f"{service.url}/v1/backends/pause", params={"mode": "freeze"})
        assert bad.status_code == 400 and "`mode`" in bad.json()["error"]["message"]
        client.pause(mode="keep", ttl_s=0.5)  # a trainer that dies mid-sync: the probe round resumes the engines
        deadline = time.monotonic() + 30
        while any(_is_paused(url) for url in urls) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_is_paused(url) for url in urls)
    finally:
        for backend in (*backends, dead):
            client.remove_backend(backend.id)
        client.resume()


def test_update_weights_loads_every_engine_of_the_model_and_names_those_that_failed(
    service, client, scripted_server, tiny_tokenizer_dir, tiny_model_dir, tmp_path
):
    import httpx

    from rollout_service.devtools.redis_server import free_port
    from rollout_service.devtools.reference_server import ReferenceServerProcess
    from rollout_service.errors import ApiError

    engine = ReferenceServerProcess(
        ["--model", str(tiny_model_dir)], port=free_port(), log_path=tmp_path / "engine.log"
    ).start()
    loaded = client.add_backend(engine.url, "reference", "reloaded", tokenizer=str(tiny_model_dir))
    try:
        for path, problem in (
            ("relative/dir", "absolute"),
            (str(tmp_path / "nowhere"), "not a directory"),
            (str(tmp_path), "no config.json"),
        ):
            answer = httpx.post(
                f"{service.url}/v1/backends/update_weights", json={"model_path": path, "model": "reloaded"}
            )
            assert answer.status_code == 400 and "`model_path`" in answer.json()["error"]["message"]
            assert problem in answer.json()["error"]["message"] and path in answer.json()["error"]["message"]
        unknown = httpx.post(
            f"{service.url}/v1/backends/update_weights",
            json={"model_path": str(tiny_model_dir), "model": "no-such-pool"},
        )
        assert unknown.status_code == 400 and "no-such-pool" in unknown.json()["error"]["message"]
        before = client.backends()[0].policy_version
        done = client.update_weights(str(tiny_model_dir), model="reloaded")
        assert done["policy_version"] == before + 1 and [e["ok"] for e in done["engines"]] == [True]
        assert httpx.get(f"{engine.url}/health").json()["weights_version"] == 1
        scripted = client.add_backend(
            scripted_server({"episodes": []}), "reference", "reloaded", tokenizer=str(tiny_tokenizer_dir)
        )
        try:
            with pytest.raises(ApiError) as failed:
                client.update_weights(str(tiny_model_dir), model="reloaded", policy_version=before + 9)
            assert failed.value.http_status == 502
            assert scripted.url in str(failed.value) and "no weights to update" in str(failed.value)
            assert engine.url not in str(failed.value).split("did not load")[1]
            assert client.backends()[0].policy_version == before + 1
        finally:
            client.remove_backend(scripted.id)
    finally:
        client.remove_backend(loaded.id)
        engine.stop()


def test_the_run_stage_begin_makes_the_first_call_in_the_same_script_only_for_a_job_it_begins(
    pool: BackendPool, redis_client: redis.Redis
) -> None:
    """``first_call_with_begin``: the stage's begin and the first call's start are one script call;
    a job the begin refuses (cancelled, leased, already past the stage) gets no call, no assignment."""
    from rollout_service.schemas import JobRequest, JobStatus
    from rollout_service.state.store import JobStore

    store = JobStore(redis_client)
    register(pool, 2)
    request = JobRequest.model_validate({"task": {"domain": "math", "problem": "1+1", "answer": "2"}})

    def begin(job_id: str, owner: str = "w1") -> tuple[str, list]:
        answers: list = []
        ((verdict, _, _),) = store.begin_stages(
            [job_id],
            "run",
            JobStatus.initializing,
            JobStatus.running,
            owner,
            skipping=(JobStatus.queued, "init_start"),
            calls={job_id: pool.first_call_with_begin(job_id, answers)},
        )
        return verdict, answers

    (job, later, cancelled), _ = store.create_many([request.model_copy(update={"n": 3})])[0]
    redis_client.hset(store.key(job), "first_call_model", MODEL)
    redis_client.hdel(store.key(later), "first_call_model")
    verdict, answers = begin(job)
    assert verdict == "ok" and len(answers) == 1
    granted, assigned = answers[0]()
    assert granted.id == pool.backend_of(job) and assigned
    assert pool.inflight_calls() == 1 and sum(live(pool).values()) == 1
    fields = store.fields(job)
    assert (
        fields["status"] == "running" and fields["attempts_run"] == "1" and fields["init_start"] == fields["run_start"]
    )
    assert begin(job, "w2") == ("leased", [])  # a duplicate delivery: no second call
    assert pool.inflight_calls() == 1 and sum(live(pool).values()) == 1

    verdict, answers = begin(later)  # init recorded no model: the episode's first call decides
    assert verdict == "ok" and answers[0]() == ("later", False) and pool.backend_of(later) is None

    store.request_cancel(cancelled)
    assert begin(cancelled) == ("cancelled", [])
    assert pool.backend_of(cancelled) is None and pool.inflight_calls() == 1
    assert_exact(pool, redis_client)


def test_a_probe_round_resumes_the_engines_once_a_pause_that_paused_them_lapsed(
    pool: BackendPool, servers: list[HealthServer]
) -> None:
    """A trainer that died mid-sync leaves the engines paused: the first probe round after its
    pause lapsed resumes them, once; a pause that did not pause the engines resumes nothing."""
    for server in servers:
        pool.register(spec(server.port))
    pool.pause(0.3)
    pool.engines_paused(True)
    pool.probe(timeout_s=1.0)
    assert [server.posted for server in servers] == [[], []]  # the pause holds
    time.sleep(0.4)
    for _ in range(2):
        assert set(pool.probe(timeout_s=1.0).values()) == {True}
    assert [server.posted for server in servers] == [["/resume"], ["/resume"]]
    pool.pause(0.1)
    time.sleep(0.2)
    pool.probe(timeout_s=1.0)
    assert [server.posted for server in servers] == [["/resume"], ["/resume"]]


def redis_commands(r: redis.Redis, action: Callable[[], object]) -> dict[str, int]:
    """The commands Redis ran for ``action``, by name (a script's own commands included)."""

    def calls() -> dict[str, int]:
        stats = r.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in stats.items()}

    before = calls()
    action()
    after = calls()
    ran = {name: count - before.get(name, 0) for name, count in after.items() if name != "info"}
    return {name: count for name, count in ran.items() if count}


def test_an_episodes_calls_cost_the_redis_commands_of_one_script_or_pipeline_each(
    pool: BackendPool, redis_client: redis.Redis
) -> None:
    """The hot path's Redis cost, pinned: a call's start and a job's release are one script each,
    a call's end, a version read and a gate call's check one pipeline of plain commands."""
    register(pool, 2)
    job_key = "t:job:j"
    redis_client.hset(job_key, "first_call_model", MODEL)
    pool.start_call("warm", MODEL, job_key)  # scripts loaded, the job's sticky backend set
    pool.release("warm")
    pool.renew_busy_gate("w", 1.0, True)

    assert redis_commands(redis_client, lambda: pool.start_call("j", MODEL, job_key)) == {
        "evalsha": 1,
        "hmget": 2,
        "get": 2,
        "exists": 1,
        "sismember": 1,
        "zrange": 1,
        "zincrby": 1,
        "hincrby": 2,
        "sadd": 1,
        "set": 1,
    }
    assert redis_commands(redis_client, lambda: pool.start_call("j", MODEL, job_key)) == {
        "evalsha": 1,
        "hmget": 2,
        "get": 2,
        "exists": 1,
        "zscore": 1,
        "hincrby": 1,
    }
    assert redis_commands(redis_client, lambda: pool.end_counted_call("j")()) == {"hincrby": 1, "get": 1}
    assert redis_commands(redis_client, lambda: pool.version_soon()()) == {"get": 1}
    assert redis_commands(redis_client, lambda: pool.check_call_soon("j", job_key)()) == {"hget": 1, "get": 1}
    assert redis_commands(redis_client, lambda: pool.renew_busy_gate("w", 1.0, True)) == {
        "evalsha": 1,
        "time": 1,
        "zscore": 1,
        "exists": 1,
        "zadd": 1,
        "get": 1,
    }
    assert redis_commands(redis_client, lambda: pool.release("j")) == {
        "evalsha": 1,
        "get": 1,
        "del": 1,
        "srem": 1,
        "hget": 2,
        "zincrby": 1,
    }


def test_each_part_of_the_pool_works_alone_on_the_shared_state(pool: BackendPool, redis_client: redis.Redis) -> None:
    """The pool's parts, each built on its own, see one state: what one writes the others read."""
    from rollout_service.state.backends.assignment import Assignments
    from rollout_service.state.backends.calls import InflightCalls
    from rollout_service.state.backends.gates import CallGates
    from rollout_service.state.backends.health import BackendHealth
    from rollout_service.state.backends.registry import BackendRegistry
    from rollout_service.state.backends.weight_sync import WeightSync

    registry = BackendRegistry(redis_client, "t")
    assignments = Assignments(redis_client, "t")
    health, sync = BackendHealth(redis_client, "t"), WeightSync(redis_client, "t")
    calls, gates = InflightCalls(redis_client, "t"), CallGates(redis_client, "t")
    first, second = (registry.register(spec(port)).id for port in (9001, 9002))
    assert [view.id for view in pool.list()] == [first, second] == [view.id for view in registry.sorted_views()]

    held = assignments.acquire("j", None)
    assert pool.backend_of("j") == held.id and registry.get(held.id).live_assignments == 1
    health.set_health(held.id, False)
    assert not pool.get(held.id).healthy and assignments.acquire("j", None).id != held.id

    sync.pause(60)
    assert pool.paused() and assignments.start_call("j", None, "t:job:j") == "paused"
    assert gates.renew_gate("w", 1.0) is None and calls.begin_call("k") is None
    assert sync.resume() == 1 and pool.policy_version() == 1
    assert gates.renew_gate("w", 1.0) == 1 and pool.open_gates() == 1
    started = assignments.start_call("j", None, "t:job:j")
    assert isinstance(started, BackendView) and started.policy_version == 1 and calls.inflight_calls() == 1
    assert pool.end_call("j")() == 1 and calls.inflight_calls() == 0
    assignments.release("j")
    assert pool.backend_of("j") is None and {v.live_assignments for v in registry.sorted_views()} == {0}
    registry.remove(first)
    assert [view.id for view in pool.list()] == [second]
