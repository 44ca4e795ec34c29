"""A scripted SWE episode end to end: the agent inspects the example repository with bash,
fixes the bug with the editor, runs the tests and finishes; the artifact is the real git
diff and a fresh sandbox resolves it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def make_swe_task(directory: Path) -> dict:
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_swe_repo.py"), str(directory)], check=True, capture_output=True, text=True
    )
    task = json.loads(made.stdout)
    task.pop("patch")  # the gold patch is for graders, not for the agent
    return task


@pytest.fixture
def swe_task(service) -> dict:
    """The example repository under the service's state directory, the one root allowed by default."""
    return make_swe_task(service.state_dir / "repos" / uuid.uuid4().hex[:8] / "dates")


def test_a_task_whose_repo_path_is_outside_the_allowed_roots_is_refused_at_submission(service, tmp_path):
    secret = tmp_path / "private"
    task = make_swe_task(secret / "dates")
    secret.chmod(0o700)
    response = httpx.post(f"{service.url}/v1/jobs", json={"task": task})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "task.repo_path" in message and "ROLLOUT_REPO_ROOTS" in message
    linked = service.state_dir / "repos" / uuid.uuid4().hex[:8]
    linked.parent.mkdir(exist_ok=True)
    linked.symlink_to(secret / "dates")
    assert httpx.post(f"{service.url}/v1/jobs", json={"task": {**task, "repo_path": str(linked)}}).status_code == 400


def test_a_scripted_agent_fixes_the_example_repository_and_is_resolved(service, client, scripted_backend, swe_task):
    scripted_backend(
        {
            "episodes": [
                {
                    "match": "is_leap_year(1900) returns True",
                    "turns": [
                        "Let me look at the rule.\n"
                        + tool_call("bash", command="grep -n 'year % 4' dates/calendar.py"),
                        "The century rule is missing.\n"
                        + tool_call(
                            "editor",
                            command="str_replace",
                            path="dates/calendar.py",
                            old_str="    return year % 4 == 0\n",
                            new_str="    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
                        ),
                        "Now the tests.\n"
                        + tool_call("bash", command="python -m pytest -q -p no:cacheprovider 2>&1 | tail -1"),
                        "Fixed.\n" + tool_call("finish", answer="Applied the 100/400 rule in is_leap_year."),
                    ],
                }
            ]
        }
    )
    (job_id,) = client.submit(swe_task, agent={"max_turns": 8}).job_ids
    (view,) = client.wait([job_id], timeout_s=180)

    assert view.status.value == "completed", view.error
    assert view.finish_reason.value == "finished"
    patch = view.result["artifact"]["patch"]
    assert "diff --git a/dates/calendar.py b/dates/calendar.py" in patch
    assert "+    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)" in patch
    assert "tests/" not in patch and "__pycache__" not in patch
    assert view.reward == 1.0 and view.result["details"]["resolved"]
    observations = [m["content"] for m in client.trajectory(job_id).messages if m["role"] == "tool"]
    assert "return year % 4 == 0" in observations[0]
    assert "3 passed" in observations[2]
    workspace = service.state_dir / "workspaces" / job_id
    wait_for(lambda: not workspace.exists(), 30, "the ended job's workspace to be removed")


def test_a_scripted_agent_that_only_edits_the_tests_is_not_resolved(client, scripted_backend, swe_task):
    problem = swe_task["problem_statement"] = "Make the leap-year tests pass (cheating variant)."
    scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        tool_call(
                            "bash",
                            command="sed -i '1a import dates.calendar\\nis_leap_year = dates.calendar.is_leap_year = "
                            "lambda y: y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)' tests/test_calendar.py",
                        ),
                        tool_call("finish", answer="done"),
                    ],
                }
            ]
        }
    )
    (view,) = client.wait(client.submit(swe_task, agent={"max_turns": 4}).job_ids, timeout_s=180)

    assert view.status.value == "completed", view.error
    assert "tests/test_calendar.py" in view.result["artifact"]["patch"]
    assert view.reward == 0.0 and not view.result["details"]["resolved"]
