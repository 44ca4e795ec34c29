"""The eval stage through its real Celery worker: a code job's answer is graded against its hidden
tests in a fresh sandbox; a right answer gets reward 1, a wrong one 0, and the graded trajectory is
the one run stored with the reward set."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from rollout_service.schemas import BackendView, FinishReason, JobStatus
from rollout_service.sdk.client import RolloutClient
from tests.helpers import (
    assert_trajectory_is_exactly_what_the_server_returned,
    server_log,
    tool_call,
)

RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"


def code_task(tag: str) -> dict:
    return {
        "domain": "code",
        "prompt": f'def add(a, b):\n    """Sum of a and b ({tag})."""\n',
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
        "entry_point": "add",
    }


def test_eval_gives_a_right_answer_reward_1_and_a_wrong_one_reward_0(
    client: RolloutClient, scripted_model: Callable[[dict], BackendView], model_name: str
) -> None:
    tags = {"right": uuid.uuid4().hex[:8], "wrong": uuid.uuid4().hex[:8]}
    backend = scripted_model(
        {
            "episodes": [
                {"match": tags["right"], "turns": [tool_call("finish", answer=RIGHT)]},
                {"match": tags["wrong"], "turns": [tool_call("finish", answer=WRONG)]},
            ]
        }
    )
    submitted = client.submit_many(
        [
            {"task": code_task(tag), "sampling": {"model": model_name}, "agent": {"tools": ["finish"]}}
            for tag in tags.values()
        ]
    )
    views = client.wait([s.job_ids[0] for s in submitted], timeout_s=60)

    assert [v.status for v in views] == [JobStatus.completed] * 2, [v.error for v in views]
    assert [v.reward for v in views] == [1.0, 0.0]
    for view in views:
        assert view.timings.eval_s is not None and "eval" in view.timings.waits_s  # graded by the eval worker
        assert view.result is not None and view.result["details"]["total"] == 1
    assert [v.result["details"]["passed"] for v in views if v.result] == [1, 0]
    assert [v.result["artifact"]["code"].strip() for v in views if v.result] == [RIGHT.strip(), WRONG.strip()]
    requests = server_log(backend.url)
    for view in views:
        trajectory = client.trajectory(view.job_id)
        assert trajectory.reward == view.reward and trajectory.finish_reason == FinishReason.finished
        mine = [r for r in requests if r["prompt_ids"] == trajectory.prompt_ids]
        assert_trajectory_is_exactly_what_the_server_returned(trajectory, mine)
