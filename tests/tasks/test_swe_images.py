"""Real SWE-bench instances as published rows plus an ``oci:`` image built the way the official
images are (tests/swe_data): graded by the SWE-bench harness's own eval script and log parser in
a sandbox of the image, on a running service (real Redis, Celery workers, bwrap, HTTP)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures_service import Service, running_service
from tests.tasks.test_swe import tool_call

pytestmark = pytest.mark.timeout(1800)  # the first test waits for the images' build (a few minutes cold)
LONG_TURNS = {"max_new_tokens": 12000}  # a turn carrying a whole patch
RUNNERS = {  # one repository per test runner of the harness
    "django": "django/django",
    "sympy": "sympy/sympy",
    "pytest": "pallets/flask",
    "pytest, the repository's own": "pytest-dev/pytest",
}


@pytest.fixture(scope="module")
def swe_service(swe_images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    roots = ",".join(sorted({str(Path(entry["layout"]).parent) for entry in swe_images.values()}))
    with running_service(
        tmp_path_factory.mktemp("swe-service"),
        ROLLOUT_IMAGE_ROOTS=roots,
        ROLLOUT_EVAL_CONCURRENCY="2",
        ROLLOUT_SWE_EVAL_TIMEOUT_S="900",
    ) as service:
        yield service


def score(service: Service, task: dict, patch: str) -> dict:
    response = httpx.post(f"{service.url}/v1/score", json={"task": task, "submission": {"patch": patch}}, timeout=1000)
    assert response.status_code == 200, response.text
    return response.json()


def instance(swe_images, runner: str) -> dict:
    """The built instance of ``runner``'s repository (tests/swe_data/ci, or ROLLOUT_SWE_DATA's rows)."""
    return next(entry for entry in swe_images.values() if entry["row"]["repo"] == RUNNERS[runner])


def published(swe_images, runner: str) -> dict:
    """The row exactly as published, with its image: nothing converted, nothing dropped."""
    entry = instance(swe_images, runner)
    return {**entry["row"], "domain": "swe", "image": entry["image"]}


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_gold_patch_of_a_published_row_resolves_it_and_no_patch_does_not(swe_service, swe_images, runner):
    task = published(swe_images, runner)
    assert isinstance(task["FAIL_TO_PASS"], str)  # JSON strings, as published

    gold = score(swe_service, task, task["patch"])
    assert gold["reward"] == 1.0, gold["details"]
    details = gold["details"]
    assert details["resolved"] and details["stage"] == "tests-exited-0" or details["stage"].startswith("tests-exited")
    assert set(details["tests"]) == set(json.loads(task["FAIL_TO_PASS"]) + json.loads(task["PASS_TO_PASS"]))
    assert set(details["tests"].values()) <= {"PASSED", "XFAIL"}

    empty = score(swe_service, task, "")
    assert empty["reward"] == 0.0 and empty["details"]["stage"] == "empty-patch"


def test_a_patch_that_breaks_the_fix_is_graded_zero_with_each_test_s_status(swe_service, swe_images):
    task = published(swe_images, "pytest")
    reverse = task["test_patch"]  # touching only the tests: the grader resets and re-applies them
    result = score(swe_service, task, reverse)
    assert result["reward"] == 0.0
    f2p = json.loads(task["FAIL_TO_PASS"])
    assert any(result["details"]["tests"][t] != "PASSED" for t in f2p), result["details"]


@pytest.fixture
def scripted_swe_backend(swe_service: Service, scripted_server, tiny_tokenizer_dir) -> Iterator:
    registered: list[str] = []
    with swe_service.client() as client:

        def make(script: dict) -> None:
            registered.append(
                client.add_backend(scripted_server(script), "vllm", "scripted", tokenizer=str(tiny_tokenizer_dir)).id
            )

        yield make
        for backend_id in registered:
            client.remove_backend(backend_id)


def test_an_agent_that_fixes_the_repository_with_bash_in_testbed_is_resolved_and_one_that_gives_up_is_not(
    swe_service, swe_images, scripted_swe_backend
):
    task = published(swe_images, "pytest")
    opening = task["problem_statement"].strip().splitlines()[0][:60]
    fix = task["patch"]
    future = instance(swe_images, "pytest")["future_commit"]
    scripted_swe_backend(
        {
            "episodes": [
                {
                    "match": "GIVE-UP " + opening,
                    "turns": [tool_call("finish", answer="I cannot fix this.")],
                },
                {
                    "match": opening,
                    "turns": [
                        "Where am I?\n"
                        + tool_call(
                            "bash",
                            command=f"pwd; git cat-file -t {future} 2>/dev/null || echo unreachable; git status --short | wc -l; command -v python",
                        ),
                        "Apply the fix.\n"
                        + tool_call("bash", command=f"git apply <<'EOF'\n{fix}\nEOF\ngit diff --stat"),
                        tool_call("finish", answer="fixed"),
                    ],
                },
            ]
        }
    )
    with swe_service.client() as client:
        (fixed_id,) = client.submit(task, agent={"max_turns": 6}, sampling=LONG_TURNS).job_ids
        gave_up = {**task, "problem_statement": "GIVE-UP " + task["problem_statement"]}
        (gave_up_id,) = client.submit(gave_up, agent={"max_turns": 6}).job_ids
        fixed, quitter = client.wait([fixed_id, gave_up_id], timeout_s=900)

        assert fixed.status.value == "completed", fixed.error
        observations = [m["content"] for m in client.trajectory(fixed_id).messages if m["role"] == "tool"]
        assert fixed.reward == 1.0, (observations, fixed.result["artifact"], fixed.result["details"]["stage"])
        where, future, status, python = observations[0].splitlines()[:4]
        assert where == "/testbed" and future == "unreachable"  # the fix's commit is not in reach
        assert status == "0"  # a clean tree: what the image's build left untracked is excluded
        assert python == "/opt/miniconda3/envs/testbed/bin/python"  # the instance's environment is active
        prompt = "\n".join(
            str(m["content"]) for m in client.trajectory(fixed_id).messages if m["role"] in ("system", "user")
        )
        assert fix.splitlines()[5] not in prompt
        if task.get("hints_text", "").strip():
            assert task["hints_text"].strip()[:80] not in prompt

        assert quitter.status.value == "completed", quitter.error
        assert quitter.reward == 0.0 and quitter.result["artifact"]["patch"] == ""


def test_a_published_row_without_its_image_or_with_a_bad_one_is_refused_at_submission(swe_service, swe_images):
    row = {**instance(swe_images, "django")["row"], "domain": "swe"}
    answer = httpx.post(f"{swe_service.url}/v1/jobs", json={"task": row})
    assert answer.status_code == 400 and "task.image" in answer.json()["error"]["message"]
    for image, said in [
        ("oci:/etc/x:tag", "outside the directories images may be read from"),
        ("ftp://x", "no supported image transport"),
    ]:
        answer = httpx.post(f"{swe_service.url}/v1/jobs", json={"task": {**row, "image": image}})
        assert answer.status_code == 400 and said in answer.json()["error"]["message"]
    unknown = {**published(swe_images, "django"), "version": "0.1"}
    answer = httpx.post(f"{swe_service.url}/v1/jobs", json={"task": unknown})
    assert answer.status_code == 400 and "task.version" in answer.json()["error"]["message"]


def test_an_image_that_cannot_be_fetched_fails_the_job_with_an_image_error_and_no_reward(
    swe_service, swe_images, scripted_swe_backend
):
    entry = instance(swe_images, "pytest")
    task = {**published(swe_images, "pytest"), "image": f"oci:{entry['layout']}:no-such-tag"}
    task["problem_statement"] = "NO-SUCH-IMAGE " + task["problem_statement"]
    scripted_swe_backend({"episodes": [{"match": "NO-SUCH-IMAGE", "turns": [tool_call("bash", command="ls")]}]})
    with swe_service.client() as client:
        (view,) = client.wait(client.submit(task, agent={"max_turns": 2}).job_ids, timeout_s=300)
    assert view.status.value == "failed" and view.error is not None and view.error.code == "image_error", view.error
    assert "no-such-tag" in view.error.message and view.reward is None
