"""Time to K accepted GRPO groups under DAPO dynamic sampling: the service's batch API vs. an
oracle and vs. trainer-side over-sampled rounds, on one real service (gateway, Celery workers,
Redis) with a scripted LLM.

Workload (seeded): ``--tasks`` math tasks, a third each "solved" (every rollout right: reward
1, uniform, dropped), "never" (every rollout wrong: uniform, dropped) and "mixed" (rollouts
alternate right/wrong through the script's ``rotate``: informative, accepted). Each task's
episode has 1-4 turns of ``--turn-delay`` seconds (uniform range) each, so episode lengths
vary 0.4-6.4 s; non-final turns call a tool the agent does not offer (an error observation,
no sandbox), the last calls ``finish``. All approaches get the same task order, the same group
size and at most ``--inflight`` groups in flight.

- batch:  ``POST /v1/batches`` (filter nonuniform_reward, max_inflight_groups = --inflight):
          replenishes as groups finish, cancels the rest at K.
- oracle: a clairvoyant trainer that never starts a group it would drop: the same batch
          call on the task list with every uninformative task removed (same order, same cap).
          With --inflight >= the number of informative tasks it starts them all at once and
          keeps the K that finish first, which no scheduler can beat on this service: it is
          the lower bound. ``ideal_s`` is the same bound without any service overhead (the
          K-th shortest scripted informative episode).
- rounds: the trainer-side way: POST /v1/jobs for the next --inflight tasks (n = group size),
          wait for the whole round, keep the groups whose rewards differ, repeat until K.

Time to K: from the first POST until the K-th accepted group is in the trainer's hands.
Between runs the bench waits until no job is live, so runs never overlap.

    .venv/bin/python bench/dapo.py [--tasks 30] [--target 5] [--inflight 30] [--group-size 4] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_service.devtools.local_service import local_service  # noqa: E402
from rollout_service.devtools.redis_server import free_port  # noqa: E402
from rollout_service.devtools.reference_server import ReferenceServerProcess  # noqa: E402
from rollout_service.devtools.tiny_model import build_tiny_tokenizer  # noqa: E402
from rollout_service.sdk.client import RolloutClient  # noqa: E402

KINDS = ("solved", "never", "mixed")
RIGHT, WRONG = "\\boxed{4}", "\\boxed{7}"


@dataclass(frozen=True)
class TaskPlan:
    repeat: int
    index: int
    kind: str
    turn_delays_s: tuple[float, ...]

    @property
    def tag(self) -> str:
        return f"[task-{self.repeat}-{self.index}]"

    @property
    def duration_s(self) -> float:
        return sum(self.turn_delays_s)

    @property
    def informative(self) -> bool:
        return self.kind == "mixed"

    def task(self, run: str) -> dict[str, Any]:
        return {"domain": "math", "problem": f"{self.tag} ({run}) What is 2 + 2?", "answer": "4"}

    def episode(self) -> dict[str, Any]:
        def turns(answer: str, variant: str) -> list[dict[str, Any]]:
            *thinking, last = self.turn_delays_s
            steps = [
                {"text": tool_call("ipython", code=f"'{variant}{k}'"), "delay_s": d} for k, d in enumerate(thinking)
            ]
            return steps + [{"text": tool_call("finish", answer=answer), "delay_s": last}]

        if self.kind == "mixed":
            return {"match": self.tag, "rotate": [turns(RIGHT, "a"), turns(WRONG, "b")]}
        return {"match": self.tag, "turns": turns(RIGHT if self.kind == "solved" else WRONG, "a")}


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def plan_tasks(repeat: int, n: int, seed: int, turn_delay_s: tuple[float, float], max_turns: int) -> list[TaskPlan]:
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    return [
        TaskPlan(repeat, i, kind, tuple(round(rng.uniform(*turn_delay_s), 3) for _ in range(rng.randint(1, max_turns))))
        for i, kind in enumerate(kinds)
    ]


# --------------------------------------------------------------------------- the service


@dataclass
class Stack:
    url: str
    redis: redis.Redis
    backend_url: str


@contextlib.contextmanager
def service(state: Path, run_concurrency: int, tokenizer: Path, script: dict[str, Any]) -> Iterator[Stack]:
    (state / "logs").mkdir(parents=True, exist_ok=True)
    (state / "script.json").write_text(json.dumps(script))
    backend = ReferenceServerProcess(
        ["--script", str(state / "script.json"), "--tokenizer", str(tokenizer)],
        port=free_port(),
        log_path=state / "logs" / "scripted.log",
    )
    try:
        backend.start()
        with local_service(
            state,
            appendonly=False,
            ROLLOUT_RUN_CONCURRENCY=str(run_concurrency),
            ROLLOUT_INIT_CONCURRENCY="8",
            ROLLOUT_EVAL_CONCURRENCY="2",
            ROLLOUT_GATEWAY_WORKERS="2",
        ) as running:
            yield Stack(running.url, running.redis(), backend.url)
    finally:
        backend.stop()


def quiesce(stack: Stack, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.redis.scard("rollout:jobs:live") and time.monotonic() < deadline:
        time.sleep(0.1)


# --------------------------------------------------------------------------- the approaches


def via_batch(
    client: RolloutClient, tasks: list[dict[str, Any]], args: argparse.Namespace, filter: str = "nonuniform_reward"
) -> dict[str, Any]:
    started = time.monotonic()
    run = client.batch(
        tasks,
        group_size=args.group_size,
        target_groups=args.target,
        max_inflight_groups=args.inflight,
        filter=filter,
        agent=AGENT,
        trajectories=False,
        progress=False,
        wait_s=5,
        timeout_s=300,
    )
    groups = []
    for group in run:
        groups.append(group)
        if len(groups) == args.target:
            elapsed = time.monotonic() - started
    view = run.view()
    if len(groups) < args.target:
        raise SystemExit(f"batch {run.batch_id} ended with {len(groups)}/{args.target} groups: {view}")
    assert all(len(set(g.rewards)) > 1 for g in groups), "an accepted group has uniform rewards"
    return {
        "time_to_k_s": round(elapsed, 3),
        "groups_started": view.tasks_started,
        "dropped": view.dropped,
        "cancelled_groups": view.cancelled_groups,
    }


def via_rounds(client: RolloutClient, tasks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    accepted, rounds, next_task = 0, 0, 0
    while accepted < args.target:
        if next_task >= len(tasks):
            raise SystemExit(f"rounds ran out of tasks with {accepted}/{args.target} groups")
        round_tasks = tasks[next_task : next_task + args.inflight]
        next_task += len(round_tasks)
        groups = [client.submit(task, n=args.group_size, agent=AGENT).job_ids for task in round_tasks]
        views = {v.job_id: v for v in client.wait([j for g in groups for j in g], timeout_s=300, poll_s=0.05)}
        accepted += sum(
            1
            for g in groups
            if len({views[j].reward for j in g}) > 1 and all(views[j].status.value == "completed" for j in g)
        )
        rounds += 1
    return {"time_to_k_s": round(time.monotonic() - started, 3), "rounds": rounds, "groups_started": next_task}


AGENT = {"tools": ["finish"], "max_turns": 8}


def run_once(client: RolloutClient, stack: Stack, plans: list[TaskPlan], args: argparse.Namespace) -> dict[str, Any]:
    informative = [p for p in plans if p.informative]
    if len(informative) < args.target:
        raise SystemExit(f"only {len(informative)} informative tasks for --target {args.target}; add --tasks")
    results: dict[str, Any] = {
        "seed": plans[0].repeat + args.seed,
        "ideal_s": round(sorted(p.duration_s for p in informative[: args.inflight])[args.target - 1], 3),
    }
    for name, run in (
        ("batch", lambda: via_batch(client, [p.task("batch") for p in plans], args)),
        ("oracle", lambda: via_batch(client, [p.task("oracle") for p in informative], args, "none")),
        ("rounds", lambda: via_rounds(client, [p.task("rounds") for p in plans], args)),
    ):
        results[name] = run()
        quiesce(stack)
    batch_s, oracle_s, rounds_s = (results[k]["time_to_k_s"] for k in ("batch", "oracle", "rounds"))
    results.update(batch_over_oracle=round(batch_s / oracle_s, 3), rounds_over_batch=round(rounds_s / batch_s, 3))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=30)
    parser.add_argument("--target", type=int, default=5, help="K accepted groups")
    parser.add_argument("--inflight", type=int, default=30, help="groups in flight (batch, oracle) = round size")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turn-delay", type=float, nargs=2, default=(1.0, 3.0), metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="task plans (seed, seed+1, ...), one run each")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)

    plans = [
        plan_tasks(r, args.tasks, args.seed + r, tuple(args.turn_delay), args.max_turns) for r in range(args.repeats)
    ]
    with tempfile.TemporaryDirectory(prefix="dapo-bench-") as tmp:
        tmp_path = Path(tmp)
        tokenizer = build_tiny_tokenizer(tmp_path / "tokenizer")
        warmup = plan_tasks(-1, 6, 0, (0.1, 0.2), 1)
        script = {"episodes": [p.episode() for plan in [warmup, *plans] for p in plan]}
        run_concurrency = args.inflight * args.group_size + 8
        with (
            service(tmp_path / "state", run_concurrency, tokenizer, script) as stack,
            RolloutClient(stack.url, timeout_s=120) as client,
        ):
            client.add_backend(stack.backend_url, "vllm", "scripted", tokenizer=str(tokenizer))
            via_batch(
                client,
                [p.task("warmup") for p in warmup if p.informative],
                argparse.Namespace(**{**vars(args), "target": 1, "inflight": 2}),
            )
            quiesce(stack)
            runs = [run_once(client, stack, plan, args) for plan in plans]

    print(
        f"{args.tasks} tasks (a third each solved / never / mixed), K={args.target}, groups of "
        f"{args.group_size}, {args.inflight} groups in flight, {args.turn_delay[0]:g}-{args.turn_delay[1]:g} s "
        f"per turn, 1-{args.max_turns} turns"
    )
    print(f"{'seed':>4} {'ideal':>7} {'oracle':>7} {'batch':>7} {'rounds':>7}  batch/oracle  rounds/batch")
    for r in runs:
        print(
            f"{r['seed']:>4} {r['ideal_s']:>6.2f}s {r['oracle']['time_to_k_s']:>6.2f}s "
            f"{r['batch']['time_to_k_s']:>6.2f}s {r['rounds']['time_to_k_s']:>6.2f}s  "
            f"{r['batch_over_oracle']:>12.2f}  {r['rounds_over_batch']:>12.2f}"
        )
    median_over_oracle = statistics.median(r["batch_over_oracle"] for r in runs)
    median_rounds_over_batch = statistics.median(r["rounds_over_batch"] for r in runs)
    print(f"median: batch = {median_over_oracle:.2f}x oracle, rounds = {median_rounds_over_batch:.2f}x batch")
    if args.json:
        print(
            json.dumps(
                {
                    "bench": "dapo",
                    "tasks": args.tasks,
                    "target_groups": args.target,
                    "group_size": args.group_size,
                    "max_inflight_groups": args.inflight,
                    "turn_delay_s": list(args.turn_delay),
                    "runs": runs,
                    "median_batch_over_oracle": median_over_oracle,
                    "median_rounds_over_batch": median_rounds_over_batch,
                    "within_1_2x_of_oracle": median_over_oracle <= 1.2,
                    "faster_than_rounds": all(r["rounds_over_batch"] > 1 for r in runs),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
