"""The rollout-service command: submit a JSONL file and wait, with clear messages on bad input."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid


def rollout_service(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_service.cli", *args], capture_output=True,
                          text=True, env=env, timeout=180)


def test_submit_runs_every_task_of_a_jsonl_file_and_writes_one_view_per_job(service, scripted_backend, tmp_path):
    marker = uuid.uuid4().hex[:6]
    scripted_backend({"episodes": [{"match": marker, "turns": ["\\boxed{4}"]}]})
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"domain": "math", "problem": f"2+2 ({marker} #{i})", "answer": "4"})
                               for i in range(3)) + "\n")
    out = tmp_path / "out.jsonl"
    done = rollout_service("submit", str(tasks), "--n", "2", "--url", service.url, "--output", str(out),
                           env=service.env)
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
