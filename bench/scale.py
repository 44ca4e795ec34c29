"""Scale: M concurrent rollouts of T turns through the stack as a user starts it.

Starts ``rollout-service up --no-reference`` (redis, gateway under gunicorn, the Celery pools,
Flower) in a subprocess, a simulated vLLM server (``bench/sim_vllm.py``) that answers every call
after ``--delay-s``, registers it, submits M rollouts at once with the trainer's client and
waits for them. Tools: ``finish`` only (no sandbox), or with ``--sandbox`` a bwrap sandbox per
rollout and a ``bash`` command every turn. The task: a math problem whose answer the run worker
scores (``--domain math``, the default), or a coding problem whose hidden test runs in a fresh
grading sandbox in the eval stage (``--domain code``).

Reports wall time against the ideal (T x delay), per-turn service overhead from the
trajectories (run-stage time not spent in the LLM server's delay, a tool or waiting for the
sandbox to boot, per LLM call), queue wait (submit to init start, and all waits between stages), failures,
the time to fetch every trajectory, and peak RSS of the service per in-flight rollout.

    .venv/bin/python bench/scale.py --rollouts 1000 --turns 4 --delay-s 1 [--sandbox [--domain code]] [--json]
    .venv/bin/python bench/scale.py --rollouts 1000 --turns 1 --filler-tokens 8000 --delay-s 0  # fetch
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench.redis_replay import (  # noqa: E402
    WINDOW_END,
    WINDOW_START,
    Recorder,
    command_stats,
    instructions,
    mark,
    redis_cost,
    replay,
)
from rollout_service.devtools.redis_server import RedisServer, free_port  # noqa: E402
from rollout_service.devtools.tiny_model import build_tiny_tokenizer  # noqa: E402
from rollout_service.errors import DeadlineExceeded  # noqa: E402
from rollout_service.sdk.client import RolloutClient  # noqa: E402
from rollout_service.state.keys import STAGE_TIMES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU time (user + system) of each process, keyed by a short name of what it is."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            args = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        joined = " ".join(args)
        name = (
            ("worker-" + args[args.index("-Q") + 1])
            if "-Q" in args
            else "gateway"
            if "gunicorn" in joined
            else "flower"
            if "flower" in joined
            else "redis"
            if "redis-server" in joined
            else "sim-llm"
            if "sim_vllm" in joined
            else "sandbox"
            if "bwrap" in joined or "action_server" in joined
            else "up"
            if " up" in joined
            else Path(args[0]).name
            if args
            else str(pid)
        )
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores, from /proc/stat): sandboxes included."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class Stack:
    """``rollout-service up`` in a subprocess on free ports, with its own state dir."""

    def __init__(self, state: Path, env: dict[str, str], run_workers: int = 0, init_workers: int = 1) -> None:
        self.state = state
        self.run_workers = run_workers
        self.init_workers = init_workers
        self.port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in ("ROLLOUT_REDIS_URL", "ROLLOUT_API_TOKEN")},
            "ROLLOUT_STATE_DIR": str(state),
            "ROLLOUT_PORT": str(self.port),
            "ROLLOUT_FLOWER_PORT": str(free_port()),
            **env,
        }
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Stack:
        log = open(self.state / "up.log", "wb")
        workers = ["--run-workers", str(self.run_workers)] if self.run_workers else []
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollout_service.cli",
                "up",
                "--no-reference",
                *workers,
                "--init-workers",
                str(self.init_workers),
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise SystemExit(f"rollout-service up exited:\n{(self.state / 'up.log').read_text()[-3000:]}")
                if b"is up" in (self.state / "up.log").read_bytes():
                    return self
                time.sleep(0.3)
            raise SystemExit(f"rollout-service up not ready in 180 s:\n{(self.state / 'up.log').read_text()[-3000:]}")
        except BaseException:  # not up (or the bench was killed meanwhile): stop what did start
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_sim(state: Path, tokenizer: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    answer = "def f():\n    return 1\n" if args.domain == "code" else "4"
    tool = (
        ["--tool", "bash", "--tool-args", json.dumps({"command": "echo hi"}), "--finish-answer", answer]
        if args.sandbox
        else []
    )
    process = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "sim_vllm.py"),
            "--tokenizer",
            str(tokenizer),
            "--port",
            str(port),
            "--delay-s",
            str(args.delay_s),
            "--turns",
            str(args.turns),
            "--filler-tokens",
            str(args.filler_tokens),
            *tool,
        ],
        stdout=open(state / "sim.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health", timeout=1).is_success:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"simulated server did not start: {(state / 'sim.log').read_text()}")


def job_body(args: argparse.Namespace, number: int) -> dict[str, Any]:
    if args.domain == "code":
        task = {"domain": "code", "text": f"scale #{number}: write f() returning 1", "test_list": ["assert f() == 1"]}
        tools = ["bash", "finish"]
    else:
        task = {"domain": "math", "problem": f"scale #{number}: what is 2+2?", "answer": "4"}
        tools = ["bash", "finish"] if args.sandbox else ["finish"]
    sampling = {"max_new_tokens": args.filler_tokens + 64} if args.filler_tokens else {}
    return {
        "task": task,
        "agent": {"tools": tools, "max_turns": args.turns + 1},
        "sampling": sampling,
        "timeouts": {"job_s": 600},
    }


def start_profilers(
    tree: list[int], out: Path, seconds: int = 10, only: str = "", rate_hz: int = 100
) -> list[subprocess.Popen]:
    """py-spy on every Celery worker and the gateway while the rollouts run (raw stacks per process)."""
    out.mkdir(parents=True, exist_ok=True)
    profilers = []
    for pid in tree:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in argv if a]
        if "worker" in args and "-Q" in args:
            name = f"worker-{args[args.index('-Q') + 1]}-{pid}"
        elif "gunicorn" in " ".join(args):
            name = f"gateway-{pid}"
        else:
            continue
        if only and not any(name.startswith(f"worker-{queue}-") or name.startswith(queue) for queue in only.split(",")):
            continue
        profilers.append(
            subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(seconds),
                    "-r",
                    str(rate_hz),
                    "-f",
                    "raw",
                    "--nonblocking",
                    "--subprocesses",
                    "-o",
                    str(out / f"{name}.raw"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"},
            )
        )
    return profilers


def submit_all(client: RolloutClient, bodies: list[dict[str, Any]]) -> list[str]:
    if hasattr(client, "submit_many"):
        return [j for s in client.submit_many(bodies) for j in s.job_ids]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        return [
            j
            for r in pool.map(lambda b: client.submit(b["task"], **{k: v for k, v in b.items() if k != "task"}), bodies)
            for j in r.job_ids
        ]


def fetch_trajectories(client: RolloutClient, job_ids: list[str]) -> dict[str, Any]:
    if hasattr(client, "trajectories"):
        return client.trajectories(job_ids)
    from concurrent.futures import ThreadPoolExecutor

    def one(job_id: str) -> Any:
        try:
            return client.trajectory(job_id)
        except Exception:
            return None

    with ThreadPoolExecutor(16) as pool:
        return dict(zip(job_ids, pool.map(one, job_ids)))


TIMELINE_FIELDS = ("created_at", *STAGE_TIMES, "finished_at")


def read_fields(stack: Stack, job_ids: list[str], *names: str) -> list[list[bytes | None]]:
    """Each job's record fields ``names`` straight from the service's Redis (HMGET per job, one pipeline)."""
    import redis

    from rollout_service.state.store import JobStore

    client = redis.Redis.from_url((stack.state / "redis.url").read_text().strip())
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hmget(JobStore.key(job_id), *names)
    replies = pipe.execute()
    client.close()
    return replies


def write_timeline(
    job_ids: list[str],
    stamps: list[list[bytes | None]],
    started_at: float,
    path: Path,
    views: dict[str, Any],
    trajectories: dict[str, Any],
    seen: dict[str, float],
) -> None:
    """Each job's stage timestamps (``stamps``: its TIMELINE_FIELDS), in seconds since the submission
    began, its timings and the latency of each of its turns (one JSON line per job, after a first
    line with the start time)."""
    with path.open("w") as out:
        out.write(json.dumps({"started_at": started_at}) + "\n")
        for job_id, values in zip(job_ids, stamps):
            view, trajectory = views.get(job_id), trajectories.get(job_id)
            out.write(
                json.dumps(
                    {
                        "job_id": job_id,
                        **{
                            name: None if v is None else round(float(v) - started_at, 4)
                            for name, v in zip(TIMELINE_FIELDS, values)
                        },
                        "seen": round(seen[job_id] - started_at, 4) if job_id in seen else None,
                        "timings": view.timings.model_dump(mode="json") if view is not None else None,
                        "turns": [(t.kind, round(t.latency_s, 4)) for t in trajectory.turns]
                        if trajectory is not None
                        else None,
                    }
                )
                + "\n"
            )


def stats_at(url: str) -> dict[str, tuple[int, int]]:
    """``command_stats`` of the Redis at ``url``."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return command_stats(client)
    finally:
        client.close()


def redis_urls(stack: Stack) -> dict[str, str]:
    """The instances the service uses: ``state``, and ``broker`` when it has its own."""
    urls = {"state": (stack.state / "redis.url").read_text().strip()}
    if stack.env.get("ROLLOUT_BROKER_URL"):
        urls["broker"] = stack.env["ROLLOUT_BROKER_URL"]
    return urls


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        state = Path(args.state_dir or tmp)
        state.mkdir(parents=True, exist_ok=True)
        tokenizer = build_tiny_tokenizer(state / "tokenizer")
        sim, sim_url = start_sim(state, tokenizer, args)
        env = {"ROLLOUT_RUN_CONCURRENCY": str(args.run_concurrency or max(args.rollouts, 8))}
        env.update(dict(kv.split("=", 1) for kv in args.env))
        broker = state_redis = recorder = None
        if args.broker_redis:
            broker = RedisServer(state / "broker", appendonly=False).start()
            env["ROLLOUT_BROKER_URL"] = broker.url
        if args.replay:  # the state on a Redis of the bench's own, whose commands it records
            state_redis = RedisServer(state / "state-redis", disabled_commands=()).start()
            env["ROLLOUT_REDIS_URL"] = state_redis.url
            recorder = Recorder(state_redis.url, state / "state-redis.monitor")
        try:
            (state / "service").mkdir()
            with (
                Stack(state / "service", env, args.run_workers, args.init_workers) as stack,
                RolloutClient(stack.url, timeout_s=300) as client,
            ):
                client.add_backend(sim_url, "vllm", "sim", tokenizer=str(tokenizer))
                warm = submit_all(client, [job_body(args, -i) for i in range(4)])
                client.wait(warm, timeout_s=120)
                rounds = []
                for round_number in range(args.rounds):
                    rounds.append(measure_round(args, stack, client, sim, sim_url, round_number))
        finally:
            sim.terminate()
            sim.wait()
            if recorder is not None:
                recorder.stop()
            for server in (broker, state_redis):
                if server is not None:
                    server.stop()
        if recorder is not None:
            again = replay(recorder.path, args.rollouts * args.turns, batch=args.replay_batch)
            if args.replay_instructions:
                again["instructions"] = instructions(recorder.path, args.rollouts * args.turns, args.replay_batch)
            trips = rounds[0]["redis_per_turn"]["state"]["round_trips_per_turn"] * args.rollouts * args.turns
            again["stack_commands_per_round_trip"] = round(again["commands"] / max(trips, 1), 1)
            rounds[0]["redis_replay"] = again
    return {**rounds[0], "later_rounds": rounds[1:]}


def measure_round(
    args: argparse.Namespace,
    stack: Stack,
    client: RolloutClient,
    sim: subprocess.Popen,
    sim_url: str,
    round_number: int,
) -> dict[str, Any]:
    """Submit ``args.rollouts`` jobs at once, wait for all of them and summarize (one trainer step)."""
    tree = process_tree(stack.process.pid)
    base_rss = rss_mb(tree)
    cpu_before, busy_before = cpu_seconds(tree + [sim.pid]), machine_busy_s()
    replayed = args.replay and round_number == 0
    if replayed:
        mark(redis_urls(stack)["state"], WINDOW_START)
    stats_before = {name: stats_at(url) for name, url in redis_urls(stack).items()}
    bodies = [job_body(args, round_number * args.rollouts + i) for i in range(args.rollouts)]
    httpx.get(f"{sim_url}/lateness")  # forget the warm-up's calls
    started, started_at = time.monotonic(), time.time()
    profile = args.profile and round_number == args.rounds - 1
    profilers = (
        start_profilers(tree, Path(args.profile), args.profile_s, args.profile_only, args.profile_rate_hz)
        if profile
        else []
    )
    job_ids = submit_all(client, bodies)
    submitted_s = time.monotonic() - started
    peak = base_rss
    done: dict[str, Any] = {}
    deadline = started + args.timeout_s

    seen: dict[str, float] = {}

    def on_done(view: Any) -> None:
        done[view.job_id] = view
        seen[view.job_id] = time.time()

    # wait in slices so RSS can be sampled meanwhile
    while len(done) < len(job_ids) and time.monotonic() < deadline:
        peak = max(peak, rss_mb(tree))
        pending = [j for j in job_ids if j not in done]
        try:
            client.wait(pending, timeout_s=0.5, on_done=on_done)
        except DeadlineExceeded:
            pass
    wall_s = time.monotonic() - started
    sim_late_ms = httpx.get(f"{sim_url}/lateness").json()
    cpu_after, busy_s = cpu_seconds(process_tree(stack.process.pid) + [sim.pid]), machine_busy_s() - busy_before
    redis_per_turn = {
        name: redis_cost(stats_before[name], stats_at(url), args.rollouts * args.turns)
        for name, url in redis_urls(stack).items()
    }
    if replayed:
        mark(redis_urls(stack)["state"], WINDOW_END)
    for profiler in profilers:
        profiler.wait()
    views = [done.get(j) or client.get(j) for j in job_ids]
    fetch_started = time.monotonic()
    trajectories = fetch_trajectories(client, job_ids)
    fetch_s = time.monotonic() - fetch_started
    stamps = read_fields(stack, job_ids, *TIMELINE_FIELDS)
    init_at, run_at = TIMELINE_FIELDS.index("init_start"), TIMELINE_FIELDS.index("run_start")
    init_started = {job_id: float(values[init_at] or "nan") for job_id, values in zip(job_ids, stamps)}
    # when each episode began, from the trainer's submit call: the last one bounds the wall time
    run_started = [float(values[run_at]) - started_at for values in stamps if values[run_at] is not None]
    # from a job's last stamp (its eval's end) to the trainer's wait returning it
    eval_at = TIMELINE_FIELDS.index("eval_end")
    seen_after = [
        seen[job_id] - float(values[eval_at])
        for job_id, values in zip(job_ids, stamps)
        if values[eval_at] is not None and job_id in seen
    ]
    if args.timeline:
        path = Path(args.timeline)
        if round_number:
            path = path.with_name(f"{path.stem}.round{round_number + 1}{path.suffix}")
        write_timeline(job_ids, stamps, started_at, path, dict(zip(job_ids, views)), trajectories, seen)
    statuses: dict[str, int] = {}
    errors: dict[str, int] = {}
    for view in views:
        statuses[view.status.value] = statuses.get(view.status.value, 0) + 1
        if view.error:
            errors[view.error.message[:200]] = errors.get(view.error.message[:200], 0) + 1
    overheads, queued, tokens, call_excess, first_excess = [], [], [], [], []
    for view in views:
        trajectory = trajectories.get(view.job_id)
        if view.status.value != "completed" or trajectory is None:
            continue
        calls = [t for t in trajectory.turns if t.kind == "generation"]
        tool_s = sum(t.latency_s for t in trajectory.turns if t.kind == "observation")
        # the sandbox boots during the first LLM call; the first tool call's latency has the wait in it
        boot_s = (
            0.0 if getattr(view.timings, "sandbox_wait_s", None) is not None else view.timings.sandbox_boot_s or 0.0
        )
        overheads.append((view.timings.run_s - boot_s - tool_s) / len(calls) - args.delay_s)
        call_excess.extend(t.latency_s - args.delay_s for t in calls[1:])
        first_excess.extend(t.latency_s - args.delay_s for t in calls[:1])
        # the "queued": from the trainer's submit call to the job's init start (the gateway
        # stamps created_at when it writes the job, which for the last jobs of a bulk is later)
        queued.append(init_started[view.job_id] - started_at)
        tokens.append(len(trajectory.prompt_ids) + len(trajectory.response_ids))
    ideal_s = args.turns * args.delay_s
    return {
        "rollouts": args.rollouts,
        "turns": args.turns,
        "delay_s": args.delay_s,
        "sandbox": args.sandbox,
        "domain": args.domain,
        "statuses": statuses,
        "errors": errors,
        "failures": args.rollouts - statuses.get("completed", 0),
        "submit_s": round(submitted_s, 3),
        "wall_s": round(wall_s, 3),
        "ideal_s": ideal_s,
        "efficiency": round(ideal_s / wall_s, 3) if ideal_s else None,
        "overhead_per_turn_ms": {
            "p50": round(pct(overheads, 0.5) * 1000, 2),
            "p99": round(pct(overheads, 0.99) * 1000, 2),
        },
        "llm_call_excess_ms": {  # an LLM call as the run worker timed it, minus the server's delay
            "first_p50": round(pct(first_excess, 0.5) * 1000, 2),
            "later_p50": round(pct(call_excess, 0.5) * 1000, 2),
            "later_p99": round(pct(call_excess, 0.99) * 1000, 2),
        },
        "sim_late_ms": sim_late_ms,  # of that, the simulated server's own lateness in answering
        "queued_s": {"p50": round(pct(queued, 0.5), 3), "max": round(max(queued, default=float("nan")), 3)},
        "seen_after_end_s": {
            "p50": round(pct(seen_after, 0.5), 3),
            "max": round(max(seen_after, default=float("nan")), 3),
        },
        "episode_start_s": {
            "p50": round(pct(run_started, 0.5), 3),
            "max": round(max(run_started, default=float("nan")), 3),
        },
        "wait_before_s": {
            stage: {"p50": round(pct(w, 0.5), 3), "max": round(max(w, default=float("nan")), 3)}
            for stage in ("init", "run", "eval")
            for w in [[v.timings.waits_s.get(stage, 0.0) for v in views if v.timings.waits_s]]
        },
        "stage_p50_s": {
            s: round(pct([getattr(v.timings, f"{s}_s") or 0.0 for v in views], 0.5), 4) for s in ("init", "run", "eval")
        },
        "trajectory_fetch_s": round(fetch_s, 3),
        "tokens_per_trajectory_p50": pct(tokens, 0.5),
        "machine_busy_cpu_s": round(busy_s, 2),
        "cpu_s": {name: round(cpu_after[name] - cpu_before.get(name, 0.0), 2) for name in sorted(cpu_after)},
        "peak_rss_mb": round(peak, 1),
        "rss_per_rollout_mb": round((peak - base_rss) / args.rollouts, 3),
        "redis_per_turn": redis_per_turn,  # per instance: commands and µs of Redis CPU (INFO commandstats)
    }


def report(r: dict[str, Any], round_number: int) -> None:
    print(
        f"{'' if round_number == 1 else f'round {round_number}: '}{r['rollouts']} rollouts x {r['turns']} turns, {r['delay_s']} s per LLM call"
        f"{', bwrap + bash' if r['sandbox'] else ''}{', code graded in a sandbox' if r['domain'] == 'code' else ''}"
        f": {r['statuses']}"
    )
    for message, count in r["errors"].items():
        print(f"  {count} x error: {message}")
    print(f"  wall {r['wall_s']} s vs ideal {r['ideal_s']} s (efficiency {r['efficiency']}); submit {r['submit_s']} s")
    print(f"  overhead per turn p50 {r['overhead_per_turn_ms']['p50']} ms, p99 {r['overhead_per_turn_ms']['p99']} ms")
    excess = r["llm_call_excess_ms"]
    print(
        f"  LLM call beyond the server's delay: first call p50 {excess['first_p50']} ms, later calls "
        f"p50 {excess['later_p50']} ms, p99 {excess['later_p99']} ms; of which the simulated server "
        f"answered late p50 {r['sim_late_ms'].get('p50')} ms, p99 {r['sim_late_ms'].get('p99')} ms"
    )
    print(
        f"  episodes began (submit to run start) p50 {r['episode_start_s']['p50']} s, "
        f"max {r['episode_start_s']['max']} s"
    )
    print(
        f"  the trainer's wait returned a job after its end p50 {r['seen_after_end_s']['p50']} s, "
        f"max {r['seen_after_end_s']['max']} s"
    )
    print(
        f"  queued (submit to init start) p50 {r['queued_s']['p50']} s, max {r['queued_s']['max']} s; "
        f"stage p50 {r['stage_p50_s']}"
    )
    print(f"  wait before each stage: {r['wait_before_s']}")
    print(
        f"  fetch {r['rollouts']} trajectories ({r['tokens_per_trajectory_p50']} tokens each): "
        f"{r['trajectory_fetch_s']} s"
    )
    print(f"  CPU seconds during the run: {r['cpu_s']}; whole machine {r['machine_busy_cpu_s']}")
    print(f"  peak RSS {r['peak_rss_mb']} MB, {r['rss_per_rollout_mb']} MB per in-flight rollout")
    if "redis_replay" in r:
        again = r["redis_replay"]
        top = ", ".join(f"{c} {v['usec']} µs" for c, v in list(again["top"].items())[:6])
        print(
            f"  the state Redis's {again['commands']} commands of the round replayed in pipelines of "
            f"{again['batch']}: {again['usec_per_turn']} µs of its CPU per turn (median of "
            f"{again['usec_per_turn_each']}; top: {top}); the stack sent them "
            f"{again['stack_commands_per_round_trip']} per round trip; the recording (MONITOR) slowed the stack and its "
            "Redis: quote their figures from a run without --replay"
        )
        if "instructions" in again:
            counted = again["instructions"]
            print(
                f"  replayed under callgrind: {counted['instructions_per_turn']:,} instructions of Redis per turn "
                f"(inclusive, per turn: {counted['by_part']})"
            )
    for name, cost in r["redis_per_turn"].items():
        top = ", ".join(f"{c} {v['calls']}" for c, v in list(cost["top"].items())[:8])
        print(
            f"  Redis ({name}): {cost['commands_per_turn']} commands ({cost['script_calls_per_turn']} script calls, "
            f"{cost['round_trips_per_turn']} round trips) "
            f"and {cost['usec_per_turn']} µs of its CPU per turn ({cost['commandstats_usec_per_turn']} µs summed "
            f"over commandstats; top: {top})"
        )


def redis_steps(rollouts: int, turns: int) -> dict[str, Any]:
    """What each step of a job's life costs the state Redis, without the stack: the service's own
    store and backend pool (a green client, as in a run worker) against a fresh Redis, ``rollouts``
    jobs going through each step together (greenlets sharing round trips, as a run worker's
    episodes do). Per step and job: µs of Redis CPU (INFO cpu), commands, round trips."""
    import gevent
    import redis

    from rollout_service.schemas import BackendSpec, JobRequest, JobStatus
    from rollout_service.settings import get_settings
    from rollout_service.state.codec import Packed, pack
    from rollout_service.state.connection import redis_client
    from rollout_service.state.metrics_recording import Increments
    from rollout_service.state.store import JobStore, StageEnd

    with tempfile.TemporaryDirectory(prefix="bench-redis-steps-") as tmp:
        server = RedisServer(Path(tmp)).start()
        os.environ["ROLLOUT_REDIS_URL"] = server.url
        get_settings.cache_clear()
        from rollout_service.state.backends import BackendPool

        try:
            admin = redis.Redis.from_url(server.url)
            store = JobStore(redis_client())
            pool = BackendPool(store.redis)
            pool.register(BackendSpec(url="http://127.0.0.1:9", kind="vllm", model="sim", tokenizer="tok"))
            request = JobRequest.model_validate(
                {
                    "task": {"domain": "math", "problem": "2 + 2?", "answer": "4"},
                    "agent": {"tools": ["finish"]},
                    "timeouts": {"job_s": 600},
                }
            )
            trajectory = Packed(
                pack(
                    {
                        "prompt_ids": list(range(100)),
                        "response_ids": list(range(400)),
                        "logprobs": [-0.5] * 400,
                        "loss_mask": [1] * 400,
                    }
                )
            )
            job_ids: list[str] = []
            firsts: dict[str, Any] = {}

            def sample() -> tuple[float, int, int]:
                stats = command_stats(admin)
                calls = sum(c for name, (c, _) in stats.items() if name not in ("cpu", "reads", "wakeups", "info"))
                return stats["cpu"][1], calls, stats["reads"][0]

            def each(step: Any) -> None:
                gevent.joinall([gevent.spawn(step, job_id) for job_id in job_ids], raise_error=True)

            def submit() -> None:
                for start in range(0, rollouts, 32):  # as the gateway: one transaction per 32 jobs
                    for ids, _ in store.create_many([request] * min(32, rollouts - start)):
                        job_ids.extend(ids)

            def begin(job_id: str) -> None:
                answers: list[Any] = []
                store.begin_stages(
                    [job_id],
                    "run",
                    JobStatus.initializing,
                    JobStatus.running,
                    f"steps:{job_id}",
                    ("request", "prepared"),
                    (JobStatus.queued, "init_start"),
                    {job_id: pool.first_call_with_begin(job_id, answers)},
                )
                firsts[job_id] = answers[0]

            def first_call_end(job_id: str) -> None:
                firsts[job_id]()
                pool.end_counted_call(job_id)()

            def later_calls(job_id: str) -> None:
                for _ in range(turns - 1):
                    version = pool.version_soon()
                    pool.check_call_soon(job_id, JobStore.key(job_id))()
                    version()

            finished = Increments()  # the ended jobs' metrics, written together as a run worker gathers them

            def end(job_id: str) -> None:
                now = time.time()
                store.end_stages(
                    [
                        StageEnd(
                            job_id,
                            f"steps:{job_id}",
                            fields={"run_end": now, "finish_reason": "finished"},
                            blobs={"trajectory": trajectory, "result": {"artifact": {"answer": "4"}}},
                            finish=(JobStatus.completed, {"reward": 1.0, "eval_start": now, "eval_end": now}),
                            call=pool.release_with_end(job_id),
                        )
                    ],
                    finished,
                )

            def end_all() -> None:
                each(end)
                finished.write_now(store.redis, "job")
                store.redis.ping()

            def wait() -> None:
                plain = JobStore(redis.Redis.from_url(server.url))
                for start in range(0, rollouts, 100):
                    chunk = job_ids[start : start + 100]
                    plain.missing_and_ended(chunk)
                    plain.views(chunk)

            steps: dict[str, Any] = {}
            for name, run_step in (
                ("submit", submit),
                ("run stage begin with the first call", lambda: each(begin)),
                ("first call end", lambda: each(first_call_end)),
                (f"{turns - 1} later calls", lambda: each(later_calls)),
                ("stage end with the backend's release, and the metrics", end_all),
                ("trainer's wait", wait),
            ):
                before = sample()
                run_step()
                after = sample()
                steps[name] = {
                    "usec_per_job": round((after[0] - before[0]) / rollouts, 1),
                    "commands_per_job": round((after[1] - before[1]) / rollouts, 1),
                    "round_trips": after[2] - before[2],
                }
            total = sum(step["usec_per_job"] for step in steps.values())
            return {
                "bench": "redis_steps",
                "rollouts": rollouts,
                "turns": turns,
                "steps": steps,
                "usec_per_job": round(total, 1),
                "usec_per_turn": round(total / turns, 1),
            }
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--delay-s", type=float, default=1.0)
    parser.add_argument("--sandbox", action="store_true", help="bwrap sandbox + a bash command per turn")
    parser.add_argument(
        "--domain",
        choices=("math", "code"),
        default="math",
        help="with --sandbox: math (scored by the run worker) or code (a hidden test run in a "
        "fresh grading sandbox by eval)",
    )
    parser.add_argument("--filler-tokens", type=int, default=0, help="tokens before each tool call")
    parser.add_argument("--run-concurrency", type=int, default=0, help="per run worker; default: --rollouts")
    parser.add_argument("--init-workers", type=int, default=1, help="init worker processes")
    parser.add_argument(
        "--run-workers",
        type=int,
        default=0,
        help="run worker processes (rollout-service up --run-workers); default: up's own",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="submit the rollouts this many times in turn, as a trainer's steps do; "
        "the first round is reported, later ones under later_rounds",
    )
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--env", action="append", default=[], help="extra ROLLOUT_X=Y for the service")
    parser.add_argument("--profile", default="", help="py-spy every worker for 10 s under load; raw stacks here")
    parser.add_argument("--profile-s", type=int, default=10, help="with --profile: seconds to record from submission")
    parser.add_argument(
        "--profile-rate-hz",
        type=int,
        default=100,
        help="with --profile: samples per second (py-spy shows greenlets' stacks unreliably; "
        "1000 Hz slows the workers visibly)",
    )
    parser.add_argument(
        "--profile-only", default="", help="with --profile: only these queues (and/or 'gateway'), comma-separated"
    )
    parser.add_argument("--state-dir", default="", help="keep the service's state and logs here")
    parser.add_argument("--timeline", default="", help="write each job's stage timestamps here (JSON lines)")
    parser.add_argument(
        "--broker-redis", action="store_true", help="Celery's queues on a Redis of their own (ROLLOUT_BROKER_URL)"
    )
    parser.add_argument(
        "--redis-steps",
        action="store_true",
        help="no stack: each step of a job's life against a fresh Redis (the service's store and "
        "backend pool, --rollouts jobs together), µs of Redis CPU per step and job",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="also record the state Redis's commands (MONITOR, on a Redis of the bench's own) and "
        "replay the round's into a fresh Redis in big pipelines: what the commands cost by themselves",
    )
    parser.add_argument(
        "--replay-batch", type=int, default=200, help="with --replay: commands per pipeline of the replay"
    )
    parser.add_argument(
        "--replay-instructions",
        action="store_true",
        help="with --replay: replay the round once more under valgrind's callgrind: instructions per turn "
        "(no timing noise)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.redis_steps:
        from rollout_service.concurrency.green import green_process

        if not green_process():  # a run worker's client: gevent's
            return subprocess.call([sys.executable, "-m", "gevent.monkey", __file__, *sys.argv[1:]])
        steps = redis_steps(args.rollouts, args.turns)
        for name, step in steps["steps"].items():
            print(
                f"  {name}: {step['usec_per_job']} µs of Redis CPU, {step['commands_per_job']} commands per job "
                f"({step['round_trips']} round trips)"
            )
        print(
            f"{args.rollouts} jobs x {args.turns} turns: {steps['usec_per_job']} µs per job, "
            f"{steps['usec_per_turn']} µs per turn"
        )
        if args.json:
            print(json.dumps(steps))
        return 0
    if args.domain == "code" and not args.sandbox:
        parser.error("--domain code needs --sandbox (its agent writes code with bash)")
    # a killed bench must still stop the stack it started (the with-blocks' exits run on SystemExit)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    r = run(args)
    for number, result in enumerate([r, *r["later_rounds"]], 1):
        report(result, number)
    if args.json:
        print(json.dumps({"bench": "scale", **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
