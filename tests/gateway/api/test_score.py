"""``POST /v1/score`` end to end: real gateway, real eval worker, real bwrap grading sandboxes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

ADD = {
    "domain": "code",
    "entry_point": "add",
    "timeout_s": 2,
    "prompt": 'def add(a: int, b: int) -> int:\n    """a plus b"""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
}
SQUARE = {"domain": "code", "text": "Write square(x).", "test_list": ["assert square(3) == 9", "assert square(0) == 0"]}
PLANETS = {
    "domain": "stem",
    "question": "Which planet is largest?",
    "choices": ["Mercury", "Venus", "Jupiter", "Mars"],
    "answer": "C",
}


def score(service, task: dict, submission: dict) -> httpx.Response:
    return httpx.post(f"{service.url}/v1/score", json={"task": task, "submission": submission}, timeout=120)


def reward(service, task: dict, submission: dict) -> float:
    response = score(service, task, submission)
    assert response.status_code == 200, response.text
    return response.json()["reward"]


@pytest.fixture(scope="module")
def swe_task(service) -> dict:
    """The example repository under the service's state directory, the one root allowed by default."""
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_swe_repo.py"), str(service.state_dir / "repos" / "score-api" / "r")],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(made.stdout)


@pytest.mark.parametrize(
    "task, right, wrong",
    [
        (
            {"domain": "math", "problem": "1/2?", "answer": "\\frac{1}{2}"},
            {"answer": "\\boxed{0.5}"},
            {"answer": "\\boxed{0.6}"},
        ),
        (
            {"domain": "math", "problem": "sqrt 8?", "answer": "2\\sqrt{2}"},
            {"answer": "\\boxed{\\sqrt{8}}"},
            {"answer": "\\boxed{3}"},
        ),
        (PLANETS, {"answer": "The answer is (C)."}, {"answer": "\\boxed{B}"}),
        (ADD, {"code": "def add(a, b):\n    return a + b\n"}, {"code": "def add(a, b):\n    return a - b\n"}),
        (
            SQUARE,
            {"answer": "```python\ndef square(x):\n    return x ** 2\n```"},
            {"code": "def square(x):\n    return x\n"},
        ),
    ],
    ids=["math-fraction", "math-sqrt", "stem", "code-humaneval", "code-mbpp"],
)
def test_a_right_submission_scores_one_and_a_wrong_one_zero(service, task, right, wrong):
    assert reward(service, task, right) == 1.0
    assert reward(service, task, wrong) == 0.0


def test_the_score_details_say_what_was_parsed(service):
    details = score(service, PLANETS, {"answer": "Answer: B"}).json()["details"]
    assert details == {"parsed_answer": "B", "parsed_by": "answer_phrase", "gold": "C"}
    details = score(service, SQUARE, {"code": "def square(x):\n    return 9\n"}).json()["details"]
    assert details["pass_fraction"] == 0.5 and [t["status"] for t in details["tests"]] == ["passed", "failed"]


def test_code_that_loops_forever_or_eats_memory_scores_zero_in_time_and_the_worker_survives(service):
    for hostile in (
        "def add(a, b):\n    while True:\n        pass\n",
        "def add(a, b):\n    hoard = []\n    while True:\n        hoard.append(bytearray(10 ** 7))\n",
        "import os\nwhile True:\n    os.fork()\n",
    ):
        began = time.monotonic()
        assert reward(service, ADD, {"code": hostile}) == 0.0
        assert time.monotonic() - began < ADD["timeout_s"] + 10
    assert reward(service, ADD, {"code": "def add(a, b):\n    return a + b\n"}) == 1.0


def test_a_swe_patch_that_fixes_the_bug_resolves_and_one_that_edits_the_tests_does_not(service, swe_task):
    fixed = score(service, swe_task, {"patch": swe_task["patch"]}).json()
    assert fixed["reward"] == 1.0 and fixed["details"]["resolved"]
    weakened = (
        swe_task["test_patch"]
        .replace("+    assert not is_leap_year(1900)\n", "+    assert True\n")
        .replace("+    assert days_in_month(1900, 2) == 28\n", "+    assert True\n")
    )
    cheated = score(service, swe_task, {"patch": weakened}).json()
    assert cheated["reward"] == 0.0 and cheated["details"]["FAIL_TO_PASS"]["passed"] == 0


@pytest.mark.parametrize(
    "task, field",
    [
        ({"domain": "stem", "question": "q", "choices": ["a"], "answer": "A"}, "task.choices"),
        ({"domain": "code", "prompt": "def f():\n", "test": "pass"}, "task.entry_point"),
        (
            {
                "domain": "swe",
                "instance_id": "x",
                "problem_statement": "p",
                "base_commit": "abcdef1",
                "test_patch": "",
                "FAIL_TO_PASS": ["t.py::a"],
                "PASS_TO_PASS": [],
            },
            "task.repo_path",
        ),
        ({"domain": "chemistry"}, "code, math, stem, swe"),
    ],
)
def test_an_invalid_task_is_a_400_that_names_the_problem(service, task, field):
    response = score(service, task, {"answer": "A"})
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]
