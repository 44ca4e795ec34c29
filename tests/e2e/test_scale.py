"""Many rollouts at once through one run worker: all complete, all in flight together, all exact."""

from __future__ import annotations

import threading
import time

import pytest

from tests.fixtures_service import Service, running_service
from tests.helpers import assert_trajectory_is_exactly_what_the_server_returned, server_log, tool_call

ROLLOUTS = 200


def assert_workers_kept_their_broker_connection(service: Service) -> None:
    """Hundreds of tasks acking at once once exhausted kombu's broker pool; kombu then dropped
    the connection and lost a message it had just popped (one job stuck in ``queued``)."""
    for worker in ("worker-init", "worker-run", "worker-eval"):
        log = service.log(worker)
        assert "Couldn't ack" not in log and "Connection to broker lost" not in log, log[-2000:]


@pytest.mark.timeout(600)
def test_two_hundred_concurrent_scripted_rollouts_all_complete_token_exact(
    tmp_path, scripted_server, tiny_tokenizer_dir
):
    turns = [tool_call("nothing")] * 2 + [tool_call("finish", answer="\\boxed{4}")]
    url = scripted_server({"episodes": [{"match": "scale-test", "turns": turns}]}, "--latency-s", "1.0")
    with (
        running_service(
            tmp_path / "service", ROLLOUT_RUN_CONCURRENCY=str(ROLLOUTS + 56), ROLLOUT_INIT_CONCURRENCY="32"
        ) as service,
        service.client() as client,
    ):
        backend = client.add_backend(url, "vllm", "scripted", tokenizer=str(tiny_tokenizer_dir))
        bodies = [
            {
                "task": {"domain": "math", "problem": f"scale-test #{i}: 2 + 2?", "answer": "4"},
                "agent": {"tools": ["finish"]},
            }
            for i in range(ROLLOUTS)
        ]
        in_flight: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            with service.client() as watcher:
                while not stop.wait(0.2):
                    try:
                        in_flight.append(next(b.live_assignments for b in watcher.backends() if b.id == backend.id))
                    except Exception:  # a slow answer under load: sample again
                        continue

        threading.Thread(target=watch, daemon=True).start()
        job_ids = [j for s in client.submit_many(bodies) for j in s.job_ids]
        try:
            views = client.wait(job_ids, timeout_s=300)
        finally:
            stop.set()
            assert_workers_kept_their_broker_connection(service)

        assert [v.status.value for v in views] == ["completed"] * ROLLOUTS, {v.error for v in views if v.error}
        assert {v.reward for v in views} == {1.0} and {v.finish_reason.value for v in views} == {"finished"}
        assert max(in_flight) >= ROLLOUTS * 3 // 4, f"at most {max(in_flight)} rollouts were in flight at once"
        log = server_log(url)
        by_prompt = {tuple(call["prompt_ids"]): call for call in log}
        for trajectory in client.trajectories(job_ids[:: ROLLOUTS // 10]).values():
            calls = [
                by_prompt[tuple(trajectory.prompt_ids + trajectory.response_ids[: t.start])]
                for t in trajectory.turns
                if t.kind == "generation"
            ]
            assert_trajectory_is_exactly_what_the_server_returned(trajectory, calls)
        time.sleep(0.5)
        assert next(b.live_assignments for b in client.backends() if b.id == backend.id) == 0


def test_a_run_worker_runs_no_more_jobs_than_its_slots_however_many_a_message_carries(
    tmp_path, scripted_server, tiny_tokenizer_dir
):
    url = scripted_server(
        {
            "episodes": [
                {"match": "slots-test", "turns": [{"text": tool_call("finish", answer="\\boxed{4}"), "delay_s": 0.6}]}
            ]
        }
    )
    with running_service(tmp_path / "service", ROLLOUT_RUN_CONCURRENCY="2") as service, service.client() as client:
        backend = client.add_backend(url, "vllm", "scripted", tokenizer=str(tiny_tokenizer_dir))
        in_flight: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            with service.client() as watcher:
                while not stop.wait(0.05):
                    in_flight.append(next(b.live_assignments for b in watcher.backends() if b.id == backend.id))

        threading.Thread(target=watch, daemon=True).start()
        group = client.submit(
            {"domain": "math", "problem": "slots-test: 2 + 2?", "answer": "4"}, n=6, agent={"tools": ["finish"]}
        )  # one message of six jobs through every stage
        try:
            views = client.wait(group.job_ids, timeout_s=120)
        finally:
            stop.set()
        assert [v.status.value for v in views] == ["completed"] * 6
        assert max(in_flight) == 2, in_flight


def test_bench_redis_steps_prices_each_step_of_a_job_on_a_fresh_redis() -> None:
    """``bench/scale.py --redis-steps``: the service's store and pool, in a green process as in a run
    worker, step by step; the commands each step sends are the ones docs/scaling.md lists."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "scale.py"),
            "--redis-steps",
            "--rollouts",
            "40",
            "--turns",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"]
    assert list(steps) == [
        "submit",
        "run stage begin with the first call",
        "first call end",
        "2 later calls",
        "stage end with the backend's release, and the metrics",
        "trainer's wait",
    ]
    assert all(step["usec_per_job"] > 0 for step in steps.values()), steps
    commands = {name: step["commands_per_job"] for name, step in steps.items()}
    assert commands["run stage begin with the first call"] == 16  # a script (14 commands inside) and an MGET
    assert commands["first call end"] == 2 and commands["2 later calls"] == 6  # after each call: one round trip
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_bench_replay_records_the_commands_clients_sent_byte_for_byte_and_replays_the_window(tmp_path) -> None:
    """``bench/scale.py --replay``'s recorder and parser: what a client sent (binary values, quotes,
    escapes) comes back exactly, scripts' own commands are left to their script, and only the
    marked window is measured."""
    import redis

    from bench.redis_replay import NOT_REPLAYED, WINDOW_END, WINDOW_START, Recorder, instructions, mark, parse, replay
    from rollout_service.devtools.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis", disabled_commands=()).start()
    try:
        recorder = Recorder(server.url, tmp_path / "monitor")
        client = redis.Redis.from_url(server.url)
        awkward = bytes(range(256)) + b'"\\ \n\r\t end'
        client.set("before", "1")
        mark(server.url, WINDOW_START)
        client.set("blob", awkward)
        client.eval("return redis.call('INCR', KEYS[1])", 1, "counter")
        client.hset("hash", mapping={"a": "x y", "b": '"quoted"'})
        mark(server.url, WINDOW_END)
        client.set("after", "1")
        time.sleep(0.3)
        recorder.stop()
        client.close()
    finally:
        server.stop()
    commands, start, end = parse(tmp_path / "monitor")
    window = [args for args in commands[start:end] if args[0].upper() not in NOT_REPLAYED]
    assert [args[0].upper() for args in window] == [b"SET", b"EVAL", b"HSET"]  # not the script's INCR
    assert window[0] == [b"SET", b"blob", awkward]
    assert window[2] == [b"HSET", b"hash", b"a", b"x y", b"b", b'"quoted"']
    replayed = replay(tmp_path / "monitor", turns=1, repeats=1)
    assert replayed["commands"] == 3 and replayed["usec_per_turn"] > 0
    assert {"set", "eval", "hset", "incr"} <= set(replayed["top"])
    counted = instructions(tmp_path / "monitor", turns=1)
    assert counted["instructions_per_turn"] > 0 and 0 < counted["by_part"]["readQueryFromClient"]
