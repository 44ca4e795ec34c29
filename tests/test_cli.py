"""The rollout-service command: submit a JSONL file and wait, with clear messages on bad input."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from celery import Celery

from rollout_service.concurrency.priority import rank
from rollout_service.devtools.redis_server import free_port
from rollout_service.launch.commands import FLOWER_NICENESS
from rollout_service.schemas import BackendSpec
from rollout_service.state.backends import BackendPool
from tests.helpers import processes_with


def rollout_service(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_service.cli", *args], capture_output=True, text=True, env=env, timeout=180
    )


def test_submit_runs_every_task_of_a_jsonl_file_and_writes_one_view_per_job(service, scripted_backend, tmp_path):
    marker = uuid.uuid4().hex[:6]
    scripted_backend({"episodes": [{"match": marker, "turns": ["\\boxed{4}"]}]})
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "\n".join(json.dumps({"domain": "math", "problem": f"2+2 ({marker} #{i})", "answer": "4"}) for i in range(3))
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    done = rollout_service(
        "submit", str(tasks), "--n", "2", "--url", service.url, "--output", str(out), env=service.env
    )
    assert done.returncode == 0, done.stderr
    views = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(views) == 6 and {v["status"] for v in views} == {"completed"}
    assert "6 jobs: completed 6; mean reward 1.000" in done.stderr


def test_submit_names_the_line_that_is_not_json(service, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"domain": "math", "problem": "1+1", "answer": "2"}\n{oops\n')
    done = rollout_service("submit", str(tasks), "--url", service.url, env=service.env)
    assert done.returncode == 2
    assert f"{tasks}:2 is not JSON" in done.stderr


def test_submit_reports_a_rejected_task_without_a_traceback(service, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"domain": "alchemy"}\n')
    done = rollout_service("submit", str(tasks), "--url", service.url, env=service.env)
    assert done.returncode == 2
    assert "unknown domain 'alchemy'" in done.stderr and "Traceback" not in done.stderr


def test_submit_sends_model_sampling_and_agent_options_with_every_task(service, scripted_backend, tmp_path):
    marker = uuid.uuid4().hex[:6]
    script = {
        "episodes": [
            {
                "match": marker,
                "turns": ['<tool_call>\n{"name": "ipython", "arguments": {"code": "1"}}\n</tool_call>', "\\boxed{4}"],
            }
        ]
    }
    scripted_backend(script, model=f"alpha-{marker}")
    beta = scripted_backend(script, model=f"beta-{marker}")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"domain": "math", "problem": f"2+2 ({marker})", "answer": "4"}) + "\n")
    out = tmp_path / "out.jsonl"
    done = rollout_service(
        "submit",
        str(tasks),
        "--url",
        service.url,
        "--output",
        str(out),
        "--model",
        f"beta-{marker}",
        "--sampling",
        '{"temperature": 0.25}',
        "--agent",
        '{"max_turns": 1}',
        env=service.env,
    )
    assert done.returncode == 0, done.stderr
    (view,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert view["backend_id"] == beta.id and view["finish_reason"] == "max_turns"
    calls = httpx.get(f"{beta.url}/debug/requests").json()
    assert [call["params"]["temperature"] for call in calls] == [0.25]


def test_submit_exits_1_and_lists_the_jobs_that_did_not_complete(service, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"domain": "math", "problem": "1+1", "answer": "2"}) + "\n")
    done = rollout_service(
        "submit", str(tasks), "--url", service.url, "--timeouts", '{"job_s": 0.001}', env=service.env
    )
    assert done.returncode == 1, done.stderr
    assert "1 jobs: timed_out 1" in done.stderr
    assert "job-" in done.stderr.splitlines()[-1] and "timed_out" in done.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--sampling", "{temperature: 1}", "argument --sampling: not JSON"),
        ("--agent", "[1, 2]", "argument --agent: must be a JSON object, got list"),
    ],
)
def test_submit_rejects_option_json_with_exit_2_and_says_why(option, value, message, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("{}\n")
    done = rollout_service("submit", str(tasks), option, value, env=dict(os.environ))
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_worker_refuses_autoscale_on_a_pool_that_cannot_grow(redis_url):
    done = rollout_service(
        "worker", "control", "--autoscale", "8,2", env={**os.environ, "ROLLOUT_REDIS_URL": redis_url}
    )
    assert done.returncode == 2
    assert "--autoscale needs a pool that can grow (prefork, gevent), not 'threads'" in done.stderr


def test_two_run_workers_on_one_host_get_distinct_node_names_and_honour_overrides(redis_url, redis_client):
    env = {**os.environ, "ROLLOUT_REDIS_URL": redis_url}
    command = [sys.executable, "-m", "rollout_service.cli", "worker", "run", "--concurrency", "1"]
    workers = [
        subprocess.Popen(command + extra, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for extra in ([], [], ["--hostname", "custom@%h", "--pool", "prefork"])
    ]
    try:
        deadline = time.monotonic() + 60
        while len(names := sorted(k.decode() for k in redis_client.keys("rollout:worker:*"))) < 3:
            assert time.monotonic() < deadline, names
            assert all(w.poll() is None for w in workers), "a worker exited"
            time.sleep(0.3)
        host = socket.gethostname()
        generated = [n for n in names if n.startswith("rollout:worker:run-")]
        assert len(generated) == 2 and all(n.endswith(f"@{host}") for n in generated)
        assert f"rollout:worker:custom@{host}" in names
        app = Celery(broker=redis_url)
        stats = app.control.inspect(timeout=5).stats()
        assert {node: s["pool"]["max-concurrency"] for node, s in stats.items()} == {
            name.removeprefix("rollout:worker:"): 1 for name in names
        }
        assert "prefork" in stats[f"custom@{host}"]["pool"]["implementation"]
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(30)


def listening_addresses(port: int) -> set[str]:
    """IPv4 addresses with a socket listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, local_port = local.split(":")
        if state == "0A" and int(local_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_up_is_ready_only_with_the_reference_registered_marks_stale_backends_and_stops_everything(
    redis_url, redis_client, tiny_model_dir, tmp_path
):
    stale = BackendPool(redis_client).register(
        BackendSpec(url=f"http://127.0.0.1:{free_port()}", kind="vllm", model="left-from-an-earlier-run")
    )
    ports = {name: free_port() for name in ("PORT", "FLOWER_PORT", "REFERENCE_PORT")}
    state = tmp_path / "state"
    env = {
        **os.environ,
        **{f"ROLLOUT_{name}": str(port) for name, port in ports.items()},
        "ROLLOUT_REDIS_URL": redis_url,
        "ROLLOUT_STATE_DIR": str(state),
        "ROLLOUT_REFERENCE_MODEL": str(tiny_model_dir),
        "ROLLOUT_GATEWAY_WORKERS": "1",
        "ROLLOUT_RUN_CONCURRENCY": "2",
    }
    env.pop("ROLLOUT_BIND_HOST", None)
    env.pop("ROLLOUT_API_TOKEN", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "rollout_service.cli", "up", "--run-workers", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # as `up &` in a script
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 240
        while not any("unhealthy backend" in line for line in lines):
            assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
            lines.append(up.stdout.readline())
        banner = "".join(lines)
        gateway = f"http://127.0.0.1:{ports['PORT']}"
        assert "rollout-service is up" in banner and f"gateway    {gateway} " in banner
        assert f"unhealthy backend {stale.id} {stale.url}" in banner
        health = {b["id"]: b["healthy"] for b in httpx.get(f"{gateway}/v1/backends").json()["backends"]}
        (reference_id,) = set(health) - {stale.id}
        assert health == {stale.id: False, reference_id: True}
        assert listening_addresses(ports["PORT"]) == {"127.0.0.1"}
        assert listening_addresses(ports["FLOWER_PORT"]) == {"127.0.0.1"}
        while len(run_workers := redis_client.keys("rollout:worker:run-*")) < 2:  # /readyz needs one
            assert time.monotonic() < deadline, run_workers
            time.sleep(0.3)
        started = processes_with(f"ROLLOUT_STATE_DIR={state}")
        flower = {pid: rank(pid) for pid in started if b"flower" in Path(f"/proc/{pid}/cmdline").read_bytes()}
        assert flower and set(flower.values()) == {FLOWER_NICENESS}, flower  # monitoring yields to rollouts
        assert any(rank(pid) == 0 for pid in started)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert up.returncode == 0
    assert processes_with(f"ROLLOUT_STATE_DIR={state}") == []


def test_images_pull_unpacks_an_image_once_and_says_what_failed_for_the_others(tiny_image, tmp_path):
    env = {
        **os.environ,
        "ROLLOUT_IMAGE_ROOTS": str(Path(tiny_image.split(":")[1]).parent),
        "ROLLOUT_IMAGE_CACHE_DIR": str(tmp_path / "cache"),
    }
    first = rollout_service("images", "pull", tiny_image, "oci:/etc:x", "ftp://nowhere", env=env)
    assert first.returncode == 1, first.stderr
    pulled, outside, unknown = (json.loads(line) for line in first.stdout.splitlines())
    assert pulled["cached"] is False and pulled["digest"].startswith("sha256:")
    assert outside["error"]["code"] == "invalid_request" and "ROLLOUT_IMAGE_ROOTS" in outside["error"]["message"]
    assert "no supported image transport" in unknown["error"]["message"]
    again = rollout_service("images", "pull", tiny_image, env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["cached"] is True
    (listed,) = (json.loads(line) for line in rollout_service("images", "list", env=env).stdout.splitlines())
    assert listed["digest"] == pulled["digest"] and Path(listed["path"], "data", "file.txt").exists()
