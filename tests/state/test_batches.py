"""Batches: GRPO groups with DAPO dynamic sampling, replenishment and early cancel.

The first part drives the batch state machine directly against a real Redis, with
simulated workers (many threads, redelivered events) standing in for Celery. The second
part runs batches end to end through the real service; only the LLM is scripted."""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis

from rollout_service.errors import NotFound
from rollout_service.runtime.tokens import ChatRenderer, load_tokenizer
from rollout_service.schemas import TERMINAL_STATUSES, BatchRequest, JobStatus
from rollout_service.settings import Settings
from rollout_service.state.batches import BatchControl, BatchStore, batch_key
from rollout_service.state.store import JobStore
from tests.helpers import math_task, tool_call

# --------------------------------------------------------------------------- simulated workers

Outcome = Callable[[int, int], float | None]  # (task index, k-th finishing member) -> reward, None = fails


class Simulation:
    """JobStore + BatchControl on a real Redis; "workers" finish enqueued jobs with scripted outcomes."""

    def __init__(self, client: redis.Redis, outcome: Outcome) -> None:
        self.jobs = JobStore(client, Settings())
        self.queue: queue.Queue[str] = queue.Queue()
        self.control = BatchControl(self.jobs, enqueue=lambda ids, stage: [self.queue.put(j) for j in ids])
        self.outcome = outcome
        self.finished_in_group: dict[str, int] = {}
        self.lock = threading.Lock()

    def submit(self, tasks: int, **fields: object) -> str:
        request = BatchRequest(tasks=[math_task(f"task {i}") for i in range(tasks)], **fields)
        return self.control.submit(request)

    def run_one(self, job_id: str) -> str:
        """Finish ``job_id`` as its stage would (or as cancelled, if flagged) and deliver the event."""
        f = self.jobs.fields(job_id)
        if JobStatus(f["status"]) in TERMINAL_STATUSES:
            return "skipped"
        if self.jobs.cancel_requested(job_id):
            self.jobs.transition(job_id, JobStatus.cancelled, finish_reason="cancelled")
        else:
            task_index = int(f["group_id"].rsplit("-", 1)[1])
            with self.lock:
                k = self.finished_in_group[f["group_id"]] = self.finished_in_group.get(f["group_id"], -1) + 1
            reward = self.outcome(task_index, k)
            if reward is None:
                self.jobs.transition(job_id, JobStatus.failed, error_code="backend_error")
            else:
                self.jobs.transition(job_id, JobStatus.completed, reward=reward, finish_reason="finished")
        return self.control.member_done(job_id)

    def drain(self) -> list[str]:
        decisions = []
        while not self.queue.empty():
            decisions.append(self.run_one(self.queue.get()))
        return decisions

    def batch_jobs(self, batch_id: str) -> list[str]:
        return [
            key.decode().rsplit(":", 1)[1]
            for key in self.jobs.redis.scan_iter("rollout:job:job-*")
            if key.count(b":") == 2 and self.jobs.redis.hget(key, "batch_id") == batch_id.encode()
        ]


def by_task(*kinds: str) -> Outcome:
    """Task i's members score per kinds[i % len(kinds)]: "solved" 1, "never" 0, "mixed" 1 then 0s,
    "broken" fails, "flaky" fails once (its first finisher) then mixes."""

    def outcome(task: int, k: int) -> float | None:
        kind = kinds[task % len(kinds)]
        return {"solved": 1.0, "never": 0.0, "broken": None}.get(
            kind, None if kind == "flaky" and k == 0 else float(k == (1 if kind == "flaky" else 0))
        )

    return outcome


@pytest.fixture
def sim_factory(redis_client: redis.Redis) -> Callable[[Outcome], Simulation]:
    return lambda outcome: Simulation(redis_client, outcome)


def test_groups_with_uniform_rewards_are_dropped_and_the_batch_tops_itself_up_to_the_target(sim_factory):
    sim = sim_factory(by_task("solved", "mixed", "never", "mixed", "mixed"))
    batch_id = sim.submit(5, group_size=3, target_groups=2, max_inflight_groups=2, filter="nonuniform_reward")
    assert sim.queue.qsize() == 2 * 3

    sim.drain()
    view = sim.control.batches.view(batch_id)
    assert (view.status.value, view.reason) == ("completed", "target_reached")
    assert (view.accepted, view.dropped_uniform, view.cancelled_groups, view.in_flight) == (2, 2, 1, 0)
    assert view.remaining_task_indices == [4] and view.remaining_tasks == [math_task("task 4")]
    page = sim.control.batches.groups_after(batch_id, 0)
    assert [g.task_index for g in page.groups] == [1, 3] and page.done and page.cursor == "2"
    assert all(sorted(g.rewards) == [0.0, 0.0, 1.0] for g in page.groups)
    assert page.groups[0].reward_mean == pytest.approx(1 / 3)
    assert page.groups[0].reward_std == pytest.approx(0.57735, 1e-4)
    assert all(sim.jobs.status(j) in TERMINAL_STATUSES for j in sim.batch_jobs(batch_id))


def test_without_a_filter_every_finished_group_is_accepted(sim_factory):
    sim = sim_factory(by_task("solved", "never"))
    batch_id = sim.submit(4, group_size=2, target_groups=3, max_inflight_groups=4)
    sim.drain()
    view = sim.control.batches.view(batch_id)
    assert (view.accepted, view.dropped, view.cancelled_groups) == (3, 0, 1)


def test_a_redelivered_member_event_changes_no_counter(sim_factory):
    sim = sim_factory(by_task("mixed"))
    batch_id = sim.submit(3, group_size=2, target_groups=2, max_inflight_groups=1, filter="nonuniform_reward")
    first, second = sim.queue.get(), sim.queue.get()
    assert sim.run_one(first) == "waiting"
    assert sim.control.member_done(first) == "duplicate"
    assert sim.run_one(second) == "accepted"
    assert sim.control.member_done(second) == "not_in_flight"
    assert sim.control.batches.view(batch_id).accepted == 1 and sim.queue.qsize() == 2


def test_reading_a_batch_whose_keys_expired_is_not_found(sim_factory):
    sim = sim_factory(by_task("mixed"))
    batch_id = sim.submit(2, group_size=2, target_groups=1)
    batches = sim.control.batches
    assert batches.task(batch_id, 1) == math_task("task 1")
    sim.jobs.redis.delete(*sim.jobs.redis.keys(batch_key(batch_id) + "*"))
    for read in (batches.fields, batches.status, batches.view, lambda b: batches.task(b, 1)):
        with pytest.raises(NotFound, match="never existed or its TTL expired"):
            read(batch_id)


def test_a_failed_member_drops_its_group_and_cancels_its_siblings(sim_factory):
    sim = sim_factory(by_task("broken", "mixed"))
    batch_id = sim.submit(2, group_size=3, target_groups=1, max_inflight_groups=1, filter="nonuniform_reward")
    broken = [sim.queue.get() for _ in range(3)]
    assert sim.run_one(broken[0]) == "dropped_failed"
    assert [sim.jobs.status(j).value for j in broken[1:]] == ["cancelled", "cancelled"]
    sim.drain()
    view = sim.control.batches.view(batch_id)
    assert (view.accepted, view.dropped_failed, view.status.value) == (1, 1, "completed")


def test_retry_rollout_resubmits_only_the_failed_rollout_and_gives_up_after_the_limit(sim_factory):
    sim = sim_factory(by_task("flaky"))
    batch_id = sim.submit(1, group_size=2, target_groups=1, on_failure="retry_rollout", filter="nonuniform_reward")
    assert sim.drain() == ["retry", "waiting", "accepted"]
    view = sim.control.batches.view(batch_id)
    assert (view.accepted, view.retried_rollouts, view.dropped) == (1, 1, 0)
    (group,) = sim.control.batches.groups_after(batch_id, 0).groups
    assert all(r.status.value == "completed" for r in group.rollouts) and sorted(group.rewards) == [0.0, 1.0]

    sim = sim_factory(by_task("broken"))
    batch_id = sim.submit(1, group_size=2, target_groups=1, on_failure="retry_rollout", max_rollout_retries=2)
    sim.drain()
    view = sim.control.batches.view(batch_id)
    assert (view.retried_rollouts, view.dropped_failed, view.status.value) == (2 * 2, 1, "failed")


def test_a_batch_that_runs_out_of_tasks_completes_with_what_it_has(sim_factory):
    sim = sim_factory(by_task("solved", "mixed", "never"))
    batch_id = sim.submit(3, group_size=2, target_groups=3, max_inflight_groups=2, filter="nonuniform_reward")
    sim.drain()
    view = sim.control.batches.view(batch_id)
    assert (view.status.value, view.reason, view.accepted, view.dropped) == ("completed", "tasks_exhausted", 1, 2)
    assert view.remaining_tasks == []


def test_cancelling_a_batch_cancels_its_in_flight_groups_and_returns_their_tasks(sim_factory):
    sim = sim_factory(by_task("mixed"))
    batch_id = sim.submit(5, group_size=2, target_groups=3, max_inflight_groups=2)
    view = sim.control.cancel(batch_id)
    assert (view.status.value, view.cancelled_groups, view.in_flight) == ("cancelled", 2, 0)
    assert view.remaining_task_indices == [0, 1, 2, 3, 4]
    assert all(sim.jobs.status(j).value == "cancelled" for j in sim.batch_jobs(batch_id))
    assert sim.control.cancel(batch_id).cancelled_groups == 2


def test_a_reservation_left_by_a_crashed_worker_is_healed(sim_factory):
    sim = sim_factory(by_task("mixed"))
    batch_id, reserved = sim.control.batches.create(BatchRequest(tasks=[math_task("t")], group_size=2, target_groups=1))
    assert sim.queue.empty() and sim.control.batches.view(batch_id).in_flight == 1
    sim.jobs.redis.zadd(f"rollout:batch:{batch_id}:pending", {reserved[0]: time.time() - 60})
    sim.control.heal(batch_id)
    assert sim.queue.qsize() == 2
    sim.drain()
    assert sim.control.batches.view(batch_id).accepted == 1


def test_a_member_whose_event_was_lost_is_decided_by_heal(sim_factory):
    sim = sim_factory(by_task("mixed"))
    batch_id = sim.submit(1, group_size=2, target_groups=1, filter="nonuniform_reward")
    first, second = sim.queue.get(), sim.queue.get()
    sim.run_one(first)
    sim.jobs.transition(second, JobStatus.completed, reward=0.0, finished_at=time.time() - 60)  # no event sent
    assert sim.control.batches.view(batch_id).accepted == 0
    sim.control.heal(batch_id)
    assert sim.control.batches.view(batch_id).accepted == 1


def test_counters_stay_exact_with_many_workers_and_redelivered_events(sim_factory):
    sim = sim_factory(by_task("solved", "never", "mixed", "flaky", "broken", "mixed"))
    target = 12
    batch_id = sim.submit(
        120,
        group_size=4,
        target_groups=target,
        max_inflight_groups=10,
        filter="nonuniform_reward",
        on_failure="retry_rollout",
        max_rollout_retries=1,
    )
    redeliveries: queue.Queue[str] = queue.Queue()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 1.0:
            try:
                source = redeliveries if rng.random() < 0.5 else sim.queue
                job_id = source.get(timeout=0.01)
            except queue.Empty:
                continue
            idle_since = time.monotonic()
            try:
                if source is redeliveries:
                    sim.control.member_done(job_id)
                    continue
                time.sleep(rng.random() * 0.002)
                sim.run_one(job_id)
                if rng.random() < 0.4:
                    redeliveries.put(job_id)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert not errors
    store: BatchStore = sim.control.batches
    view = store.view(batch_id)
    group_ids = store.group_ids(batch_id)
    groups = [store.group(batch_id, gid) for gid in group_ids]
    assert (view.status.value, view.accepted, view.in_flight) == ("completed", target, 0)
    assert len(group_ids) == len(set(group_ids)) == view.tasks_started
    assert view.accepted + view.dropped + view.cancelled_groups == len(group_ids)
    assert sorted(g["state"] for g in groups if g["state"] == "accepted") == ["accepted"] * target
    accepted = store.groups_after(batch_id, 0).groups
    assert len(accepted) == target and len({g.group_id for g in accepted}) == target
    assert all(len(set(g.rewards)) > 1 and {r.status.value for r in g.rollouts} == {"completed"} for g in accepted)
    members = [v for g in groups for k, v in g.items() if k.startswith("slot:") and v]
    assert len(members) == len(set(members))
    assert all(sim.jobs.status(j) in TERMINAL_STATUSES for j in sim.batch_jobs(batch_id))
    assert view.retried_rollouts == sum(int(v) for g in groups for k, v in g.items() if k.startswith("retries:"))


def test_concurrent_events_for_one_group_accept_it_exactly_once(sim_factory):
    sim = sim_factory(by_task("mixed"))
    batch_id = sim.submit(2, group_size=4, target_groups=1, max_inflight_groups=1)
    members = [sim.queue.get() for _ in range(4)]
    for k, job_id in enumerate(members):
        sim.jobs.transition(job_id, JobStatus.completed, reward=float(k == 0))
    decisions: list[str] = []
    barrier = threading.Barrier(16)

    def deliver(job_id: str) -> None:
        barrier.wait()
        decisions.append(sim.control.member_done(job_id))

    threads = [threading.Thread(target=deliver, args=(members[i % 4],)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert decisions.count("accepted") == 1 and decisions.count("waiting") == 3
    view = sim.control.batches.view(batch_id)
    assert (view.accepted, view.status.value, view.in_flight) == (1, "completed", 0)


# --------------------------------------------------------------------------- scripted episodes


def test_a_rotating_script_episode_answers_each_new_rollout_of_a_prompt_differently(
    scripted_server, tiny_tokenizer_dir: Path
):
    renderer = ChatRenderer(load_tokenizer(str(tiny_tokenizer_dir)))
    url = scripted_server(
        {
            "episodes": [
                {
                    "match": "Rotate me",
                    "rotate": [[tool_call("ipython", code="1"), "first, second turn"], ["second"], ["third"]],
                }
            ]
        }
    )

    def generate(prompt: list[int]) -> list[int]:
        answer = httpx.post(
            f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 200, "return_token_ids": True}, timeout=10
        ).json()
        return answer["choices"][0]["token_ids"]

    prompt = renderer.initial_prompt([{"role": "user", "content": "Rotate me"}], [])
    first = [renderer.decode_generation(generate(prompt)) for _ in range(4)]
    assert first == [tool_call("ipython", code="1"), "second", "third", tool_call("ipython", code="1")]
    ids = renderer.encode(tool_call("ipython", code="1")) + [renderer.end_of_turn_id]
    follow_up = prompt + ids + renderer.observation_delta([{"role": "tool", "content": "1"}], ids)
    assert renderer.decode_generation(generate(follow_up)) == "first, second turn"


# --------------------------------------------------------------------------- end to end

ANSWER_RIGHT, ANSWER_WRONG = "It is \\boxed{4}.", "It is \\boxed{7}."


def solved(problem: str) -> dict:
    return {"match": problem, "turns": [ANSWER_RIGHT]}


def never(problem: str) -> dict:
    return {"match": problem, "turns": [ANSWER_WRONG]}


def mixed(problem: str) -> dict:
    """Rollouts of this prompt alternate between a right and a wrong answer."""
    return {"match": problem, "rotate": [[ANSWER_RIGHT], [ANSWER_WRONG]]}


def slow(problem: str, turns: int = 15, delay_s: float = 1.0) -> dict:
    return {
        "match": problem,
        "turns": [{"text": tool_call("ipython", code="1"), "delay_s": delay_s}] * turns + [ANSWER_RIGHT],
    }


def broken(problem: str) -> dict:
    """One tool call, then the script has no turn left: the server answers 400 and the job fails."""
    return {"match": problem, "turns": [tool_call("ipython", code="1")]}


def scripted_tasks(scripted_backend, *episodes: Callable[[str], dict]) -> list[dict]:
    """One math task (answer 4) per episode kind, and a backend that plays them."""
    problems = [f"Problem {i} ({uuid.uuid4().hex[:8]}): what is 2 + 2?" for i in range(len(episodes))]
    scripted_backend({"episodes": [make(p) for make, p in zip(episodes, problems)]})
    return [math_task(p) for p in problems]


def jobs_of(service, batch_id: str) -> dict[str, str]:
    r = service.redis()
    return {
        key.decode().rsplit(":", 1)[1]: r.hget(key, "status").decode()
        for key in r.scan_iter("rollout:job:job-*", count=1000)
        if key.count(b":") == 2 and r.hget(key, "batch_id") == batch_id.encode()
    }


def sandboxes_of(service, job_ids: set[str]) -> list[str]:
    r = service.redis()
    registered = [key for key in r.scan_iter("rollout:sandbox:*") if key != b"rollout:sandbox:expiry"]
    return [key.decode() for key in registered if (r.hget(key, "job_id") or b"").decode() in job_ids]


def bwrap_processes_of(job_ids: set[str]) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "bwrap" in cmdline and any(j in cmdline for j in job_ids):
            found.append(int(proc.name))
    return found


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def assert_nothing_of_the_batch_is_left_running(service, client, batch_id: str, finished_at: float) -> None:
    time.sleep(max(0.0, finished_at + 5 - time.time()))
    jobs = jobs_of(service, batch_id)
    still_running = {j: s for j, s in jobs.items() if JobStatus(s) not in TERMINAL_STATUSES}
    assert not still_running, f"5 s after the batch ended these jobs still run: {still_running}"
    assert wait_until(lambda: not sandboxes_of(service, set(jobs)) and not bwrap_processes_of(set(jobs)), 5)
    assert wait_until(lambda: all(b.live_assignments == 0 for b in client.backends()), 5), client.backends()


def test_a_filtered_batch_accepts_exactly_the_target_of_mixed_groups_and_cancels_the_rest(
    service, client, scripted_backend
):
    tasks = scripted_tasks(scripted_backend, slow, solved, never, mixed, solved, mixed, mixed, never, mixed)
    run = client.batch(
        tasks,
        group_size=3,
        target_groups=2,
        max_inflight_groups=3,
        filter="nonuniform_reward",
        progress=False,
        timeout_s=90,
    )
    groups = list(run)

    assert len(groups) == 2
    for group in groups:
        assert sorted(group.rewards) in ([0.0, 0.0, 1.0], [0.0, 1.0, 1.0]), "a uniform group was accepted"
        assert [r.trajectory.reward for r in group.rollouts] == group.rewards
        assert group.reward_std > 0 and group.advantages() != [0.0, 0.0, 0.0]
        assert group.task in tasks
    view = run.view()
    assert (view.status.value, view.reason, view.accepted, view.in_flight) == ("completed", "target_reached", 2, 0)
    assert view.dropped_uniform >= 2 and view.cancelled_groups >= 1 and 0 in view.remaining_task_indices
    assert view.accepted + view.dropped + view.cancelled_groups == view.tasks_started
    assert [tasks[i] for i in view.remaining_task_indices] == view.remaining_tasks
    assert_nothing_of_the_batch_is_left_running(service, client, run.batch_id, view.finished_at)
    assert "cancelled" in jobs_of(service, run.batch_id).values()


def test_a_group_with_a_failed_rollout_is_dropped_not_scored_zero(service, client, scripted_backend):
    tasks = scripted_tasks(scripted_backend, broken, mixed)
    run = client.batch(
        tasks,
        group_size=2,
        target_groups=1,
        max_inflight_groups=1,
        filter="nonuniform_reward",
        progress=False,
        trajectories=False,
        timeout_s=60,
    )
    (group,) = run
    view = run.view()
    assert group.task == tasks[1] and (view.dropped_failed, view.accepted) == (1, 1)
    failed = [j for j, s in jobs_of(service, run.batch_id).items() if s == "failed"]
    assert failed and client.get(failed[0]).error.code == "backend_rejected"


def test_retry_rollout_replaces_a_failed_rollout_in_its_group(service, client, scripted_backend):
    def flaky(problem: str) -> dict:
        return {"match": problem, "rotate": [[tool_call("ipython", code="1")], [ANSWER_RIGHT], [ANSWER_WRONG]]}

    tasks = scripted_tasks(scripted_backend, flaky)
    run = client.batch(
        tasks,
        group_size=2,
        target_groups=1,
        filter="nonuniform_reward",
        on_failure="retry_rollout",
        progress=False,
        trajectories=False,
        timeout_s=60,
    )
    (group,) = run
    assert sorted(group.rewards) == [0.0, 1.0] and {r.status.value for r in group.rollouts} == {"completed"}
    view = run.view()
    assert (view.accepted, view.retried_rollouts, view.dropped) == (1, 1, 0)
    assert sorted(jobs_of(service, run.batch_id).values()) == ["completed", "completed", "failed"]


def test_a_batch_whose_tasks_run_out_completes_short_and_one_whose_groups_all_fail_fails(
    service, client, scripted_backend
):
    tasks = scripted_tasks(scripted_backend, solved, never, broken)
    short = client.batch(tasks[:2], group_size=2, target_groups=2, filter="nonuniform_reward", progress=False)
    assert list(short) == []
    view = short.view()
    assert (view.status.value, view.reason, view.accepted, view.dropped_uniform) == (
        "completed",
        "tasks_exhausted",
        0,
        2,
    )
    doomed = client.batch(tasks[2:], group_size=2, target_groups=1, progress=False)
    assert list(doomed) == [] and doomed.view().status.value == "failed"


def test_cancelling_a_batch_stops_its_rollouts_and_returns_its_tasks(service, client, scripted_backend):
    tasks = scripted_tasks(scripted_backend, slow, slow, slow)
    run = client.batch(tasks, group_size=2, target_groups=1, max_inflight_groups=2, progress=False)
    assert wait_until(lambda: "running" in jobs_of(service, run.batch_id).values(), 30)
    view = run.cancel()
    assert (view.status.value, view.cancelled_groups, view.in_flight) == ("cancelled", 2, 0)
    assert view.remaining_tasks == tasks
    assert_nothing_of_the_batch_is_left_running(service, client, run.batch_id, view.finished_at)


@pytest.mark.parametrize(
    "change, complaint",
    [
        ({"filter": "dapo"}, "filter"),
        ({"on_failure": "ignore"}, "on_failure"),
        ({"tasks": []}, "tasks"),
        ({"tasks": [{"problem": "no domain"}]}, 'tasks[0]: task needs a "domain"'),
        ({"tasks": [math_task("fine"), {"domain": "math", "problem": "no answer"}]}, "tasks[1]: task.answer"),
        ({"tasks": [{"domain": "chess"}]}, "unknown domain 'chess'"),
        ({"target_groups": 3}, "target_groups (3) exceeds the number of tasks (2)"),
        ({"group_size": 1, "filter": "nonuniform_reward"}, "group_size >= 2"),
        ({"max_inflight_groups": 0}, "max_inflight_groups"),
        ({"group_sise": 4}, "group_sise"),
    ],
)
def test_a_bad_batch_is_a_400_that_names_the_problem(service, change, complaint):
    body = {"tasks": [math_task("a"), math_task("b")], "group_size": 2, "target_groups": 1, **change}
    answer = httpx.post(f"{service.url}/v1/batches", json=body)
    assert answer.status_code == 400 and complaint in answer.json()["error"]["message"]


def test_an_unknown_batch_is_a_404_and_a_bad_cursor_a_400(service):
    assert httpx.get(f"{service.url}/v1/batches/batch-missing").status_code == 404
    assert httpx.get(f"{service.url}/v1/batches/batch-missing/groups").status_code == 404
    assert httpx.post(f"{service.url}/v1/batches/batch-missing/cancel").status_code == 404
