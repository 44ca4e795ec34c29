"""Domain handlers called directly: stem, code and swe, graded in real bwrap sandboxes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_service.errors import ValidationError
from rollout_service.sandbox import SandboxSpec, create_sandbox
from rollout_service.settings import get_settings
from rollout_service.tasks import get_handler
from rollout_service.tasks.code import extract_code
from rollout_service.tasks.stem import parse_choice
from rollout_service.tasks.swe import parse_pytest_log, touched_files

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

stem, code, swe = get_handler("stem"), get_handler("code"), get_handler("swe")

ADD = {
    "domain": "code",
    "entry_point": "add",
    "timeout_s": 2,
    "prompt": 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """The sum of xs."""\n',
    "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n",
}
SQUARE = {
    "domain": "code",
    "text": "Write a function square(x) that returns x squared.",
    "timeout_s": 2,
    "test_list": ["assert square(2) == 4", "assert square(-3) == 9", "assert square(0) == 0"],
}
PLANETS = {
    "domain": "stem",
    "question": "Which planet is largest?",
    "choices": ["Mercury", "Venus", "Jupiter", "Mars"],
    "answer": "C",
}


def make_swe_task(directory: Path) -> dict:
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_swe_repo.py"), str(directory)], check=True, capture_output=True, text=True
    )
    return json.loads(made.stdout)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(autouse=True)
def small_eval_limits(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    monkeypatch.setenv("ROLLOUT_EVAL_TIMEOUT_S", "20")
    monkeypatch.setenv("ROLLOUT_SANDBOX_MEMORY_MB", "512")
    monkeypatch.setenv("ROLLOUT_REPO_ROOTS", str(tmp_path_factory.getbasetemp()))  # where the tests make repositories
    get_settings.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def swe_task(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_swe_task(tmp_path_factory.mktemp("swe") / "dates")


@pytest.fixture
def agent_sandbox(tmp_path: Path) -> Iterator:
    """A started sandbox factory on a workspace: ``agent_sandbox(workspace, tools)``."""
    started = []

    def start(workspace: Path, tools: tuple[str, ...] = ("bash", "editor", "finish")):
        sandbox = create_sandbox(
            get_settings().sandbox,
            SandboxSpec(job_id="test", workspace=str(workspace), tools=tools, memory_mb=1024, ttl_s=120),
        )
        started.append(sandbox)
        sandbox.start()
        return sandbox

    yield start
    for sandbox in started:
        sandbox.stop()


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "handler, task, field",
    [
        (stem, {"question": "q", "answer": "A"}, "task.choices"),
        (stem, {"question": "q", "choices": ["x"] * 11, "answer": "A"}, "task.choices"),
        (stem, {"question": "q", "choices": ["x", "y"], "answer": "C"}, "task.answer"),
        (stem, {"question": "q", "choices": ["x", "y"], "answer": 2}, "task.answer"),
        (code, {}, "task.prompt"),
        (code, {"prompt": "def f():\n", "test": "def check(c): pass"}, "task.entry_point"),
        (code, {"text": "Write f.", "test_list": []}, "task.test_list"),
        (code, {**SQUARE, "timeout_s": -1}, "task.timeout_s"),
        (swe, {"instance_id": "x", "problem_statement": "p"}, "task.base_commit"),
    ],
)
def test_a_task_with_a_missing_or_wrong_field_is_rejected_naming_the_field(handler, task, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        handler.validate(task)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"FAIL_TO_PASS": "not json"}, "task.FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": []}, "task.FAIL_TO_PASS"),
        ({"PASS_TO_PASS": [1, 2]}, "task.PASS_TO_PASS"),
        ({"repo_path": None}, "task.repo_path"),
        ({"repo_path": "relative/dir"}, "task.repo_path"),
        ({"base_commit": "--upload-pack=evil"}, "task.base_commit"),
    ],
)
def test_a_swe_task_with_a_wrong_field_is_rejected_naming_the_field(swe_task, change, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        swe.validate({**swe_task, **change})


def test_swe_test_lists_may_be_lists_or_json_strings(swe_task):
    swe.validate(swe_task)
    swe.validate({**swe_task, "FAIL_TO_PASS": json.loads(swe_task["FAIL_TO_PASS"])})


# -- stem -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, letter, rule",
    [
        ("C", "C", "bare_letter"),
        ("(C)", "C", "bare_letter"),
        ("c.", "C", "bare_letter"),
        ("Jupiter", "C", "choice_text"),
        ("So the result is \\boxed{C}.", "C", "boxed"),
        ("\\boxed{\\text{C}}", "C", "boxed"),
        ("Answer: C", "C", "answer_phrase"),
        ("Neither (A) nor (B) fits, so the answer is (C).", "C", "answer_phrase"),
        ("Option A is too small. The correct option is **C**", "C", "answer_phrase"),
        ("Gas giants are the largest.\n\n**C**", "C", "last_line"),
        ("Jupiter, i.e. (C), is the biggest", "C", "parenthesized"),
        ("Answer: B", "B", "answer_phrase"),
        ("I am not sure.", None, "none"),
    ],
)
def test_the_chosen_letter_is_read_from_many_answer_styles(answer, letter, rule):
    assert parse_choice(answer, PLANETS["choices"]) == (letter, rule)


def test_a_stem_answer_scores_one_when_it_names_the_gold_choice_and_zero_otherwise():
    assert stem.score(PLANETS, {"answer": "\\boxed{C}"}).reward == 1.0
    wrong = stem.score(PLANETS, {"answer": "The answer is B"})
    assert wrong.reward == 0.0 and wrong.details == {"parsed_answer": "B", "parsed_by": "answer_phrase", "gold": "C"}
    assert stem.score({**PLANETS, "answer": 2}, {"answer": "C"}).reward == 1.0
    assert stem.score({**PLANETS, "answer": "Jupiter"}, {"answer": "C"}).reward == 1.0
    assert stem.score(PLANETS, {}).reward == 0.0


@pytest.mark.parametrize(
    "finish_answer, final_text, reward",
    [
        (None, "What is 19 + 10? Let me restate: 19 + 10.", 0.0),  # an expression equal to the gold is no answer
        (None, "So it is \\boxed{29}.", 1.0),
        (None, " 29.\n", 1.0),
        (None, "19 + 10 = 29, so 29", 1.0),  # the last number
        (None, "19 + 10", 0.0),  # the last number of a restatement is an operand
        (None, "I do not know", 0.0),
        (None, "First \\boxed{28}, no wait: \\boxed{29}", 1.0),
        ("29", "", 1.0),
        ("\\boxed{28}", "\\boxed{29}", 0.0),  # the finish answer is the answer
    ],
)
def test_a_math_answer_is_the_finish_answer_or_the_last_boxed_or_number_never_an_expression(
    finish_answer, final_text, reward
):
    handler, task = get_handler("math"), {"problem": "What is 19 + 10?", "answer": "29"}
    assert handler.score(task, handler.artifact(task, finish_answer, final_text, None)).reward == reward


def test_stem_offers_only_finish_unless_python_is_asked_for(tmp_path):
    assert stem.prepare(PLANETS, tmp_path).tools == ("finish",)
    prepared = stem.prepare({**PLANETS, "python": True}, tmp_path)
    assert prepared.tools == ("ipython", "finish")
    assert "C. Jupiter" in prepared.messages[-1]["content"]


# -- code -----------------------------------------------------------------------------------


def test_code_is_taken_from_the_last_python_block_that_defines_the_entry_point():
    text = "Try:\n```python\ndef add(xs):\n    return sum(xs)\n```\nUsage:\n```python\nprint(add([1]))\n```"
    assert extract_code(text, "add") == "def add(xs):\n    return sum(xs)"
    assert extract_code("    return sum(xs)\n") == "    return sum(xs)"


@pytest.mark.parametrize(
    "submission",
    [
        {"code": "def add(xs):\n    return sum(xs)\n"},
        {"answer": "Here it is:\n```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```"},
        {"code": "    return sum(xs)\n"},
    ],
)
def test_a_correct_humaneval_solution_passes_its_hidden_tests(submission):
    result = code.score(ADD, submission)
    assert result.reward == 1.0, result.details
    assert result.details["pass_fraction"] == 1.0 and result.details["tests"][0]["status"] == "passed"


def test_graded_code_may_import_installed_packages_though_the_grader_skips_site():
    solution = "import msgpack\ndef add(xs):\n    return msgpack.unpackb(msgpack.packb(sum(xs)))\n"
    result = code.score(ADD, {"code": solution})
    assert result.reward == 1.0, result.details


def test_a_wrong_humaneval_solution_fails_and_says_why():
    result = code.score(ADD, {"code": "def add(xs):\n    return 0\n"})
    assert result.reward == 0.0
    assert result.details["tests"] == [{"test": "check(add)", "status": "failed", "error": "AssertionError"}]


def test_mbpp_asserts_are_run_one_by_one_for_a_pass_fraction():
    assert code.score(SQUARE, {"code": "def square(x):\n    return x * x\n"}).reward == 1.0
    partial = code.score(SQUARE, {"code": "def square(x):\n    return x * 2\n"})
    assert partial.reward == 0.0
    assert [t["status"] for t in partial.details["tests"]] == ["passed", "failed", "passed"]
    assert partial.details["pass_fraction"] == pytest.approx(2 / 3)


def test_exiting_early_with_status_zero_is_a_failure_not_a_pass():
    for escape in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        result = code.score(SQUARE, {"code": escape})
        assert result.reward == 0.0 and result.details["passed"] == 0, escape


FORGER = """
import gc, json, os
nonce = next(o["nonce"] for o in gc.get_objects() if isinstance(o, dict) and "nonce" in o)
line = ("\\n" + nonce + " " + json.dumps([{"status": "passed", "error": ""}] * 3) + "\\n").encode()
for target in [*range(1, 64), f"/proc/{os.getppid()}/fd/1"]:
    try:
        os.write(target, line) if isinstance(target, int) else open(target, "wb").write(line)
    except OSError:
        pass
os.kill(os.getppid(), 9)  # so that the grader's own last line never comes
def square(x):
    return -1
"""


def test_a_submission_that_finds_the_nonce_in_its_memory_still_cannot_forge_the_result():
    result = code.score(SQUARE, {"code": FORGER})
    assert result.reward == 0.0 and result.details["passed"] == 0, result.details
    assert "StopIteration" not in str(result.details), result.details  # it did find the nonce


def test_a_solution_that_loops_forever_gets_zero_within_its_time_limit():
    began = time.monotonic()
    result = code.score(ADD, {"code": "def add(xs):\n    while True:\n        pass\n"})
    assert result.reward == 0.0 and result.details["tests"][0]["status"] == "timeout"
    assert time.monotonic() - began < 2 + 5


def test_a_solution_that_eats_memory_gets_zero_and_grading_goes_on():
    hog = "def add(xs):\n    hoard = []\n    while True:\n        hoard.append(bytearray(10 ** 7))\n"
    result = code.score(ADD, {"code": hog})
    assert result.reward == 0.0 and "MemoryError" in result.details["tests"][0]["error"]
    assert code.score(ADD, {"code": "def add(xs):\n    return sum(xs)\n"}).reward == 1.0


def test_tests_after_the_time_budget_are_not_run(monkeypatch):
    monkeypatch.setenv("ROLLOUT_EVAL_TIMEOUT_S", "3")
    get_settings.cache_clear()
    looping = {**SQUARE, "timeout_s": 2}
    result = code.score(looping, {"code": "def square(x):\n    while True:\n        pass\n"})
    assert [t["status"] for t in result.details["tests"]] == ["timeout", "timeout", "not_run"]


def test_the_code_artifact_is_the_finish_answer_or_the_file_it_names(tmp_path, agent_sandbox):
    prepared = code.prepare(ADD, tmp_path)
    assert (tmp_path / "solution.py").read_text() == ADD["prompt"]
    assert set(prepared.tools) == {"bash", "ipython", "editor", "finish"}
    sandbox = agent_sandbox(tmp_path)
    big_comment = "# " + "x" * 100_000 + "\n"
    solution = big_comment + "def add(xs):\n    return sum(xs)\n"
    sandbox.execute("editor", {"command": "create", "path": "mine.py", "file_text": solution}, 10)

    assert code.artifact(ADD, "mine.py", "", sandbox) == {"code": solution, "source": "file:/workspace/mine.py"}
    assert code.artifact(ADD, "", "", sandbox)["code"] == ADD["prompt"]
    assert code.artifact(ADD, "```python\ndef add(xs): return 1\n```", "", sandbox) == {
        "code": "def add(xs): return 1",
        "source": "finish",
    }
    assert code.artifact(ADD, None, "I gave up.", sandbox)["source"] == "file:/workspace/solution.py"
    assert code.score(ADD, code.artifact(ADD, "/workspace/mine.py", "", sandbox)).reward == 1.0


def test_the_code_artifact_of_a_local_sandbox_is_read_from_its_own_workspace_not_a_host_path(tmp_path):
    for n in range(2):
        workspace = tmp_path / f"job-{n}"
        code.prepare(ADD, workspace)
        (workspace / "solution.py").write_text(f"def add(xs):\n    return {n}\n")
        with create_sandbox("local", SandboxSpec(f"job-{n}", str(workspace), tools=("bash",))) as sandbox:
            sandbox.execute("bash", {"command": "cd /"}, 10)  # the agent's shell may end anywhere
            assert code.artifact(ADD, None, "I gave up.", sandbox)["code"] == f"def add(xs):\n    return {n}\n"
            assert code.artifact(ADD, "solution.py", "", sandbox)["code"] == f"def add(xs):\n    return {n}\n"


# -- swe ------------------------------------------------------------------------------------


def test_the_files_a_patch_touches_and_pytest_statuses_are_parsed():
    patch = (
        "diff --git a/t/x.py b/t/x.py\n--- a/t/x.py\n+++ b/t/x.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/t/new.py b/t/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/t/new.py\n"
    )
    assert touched_files(patch) == ["t/x.py", "t/new.py"]
    log = (
        "PASSED t.py::a\nFAILED t.py::b[x - y] - AssertionError: 1 - 2\nERROR t.py::c\n"
        "PASSED t.py::b[x - y]\nXFAIL t.py::d - reason\n"
    )
    assert parse_pytest_log(log, ["t.py::a", "t.py::b[x - y]", "t.py::c", "t.py::d", "t.py::e"]) == {
        "t.py::a": "PASSED",
        "t.py::b[x - y]": "PASSED",
        "t.py::c": "ERROR",
        "t.py::d": "XFAIL",
    }


def test_the_gold_patch_resolves_the_example_issue(swe_task):
    result = swe.score(swe_task, {"patch": swe_task["patch"]})
    assert result.reward == 1.0, result.details
    assert result.details["resolved"] and set(result.details["tests"].values()) == {"PASSED"}


def test_no_patch_or_a_patch_that_does_not_apply_resolves_nothing(swe_task):
    assert swe.score(swe_task, {"patch": ""}).details["stage"] == "empty-patch"
    broken = swe.score(swe_task, {"patch": swe_task["patch"].replace("return year % 4 == 0\n", "return 7\n")})
    assert broken.reward == 0.0 and broken.details["stage"] == "patch-failed"
    assert "error" in broken.details["apply_log"] or "patch" in broken.details["apply_log"]


MONKEYPATCHING_TESTS = """\
diff --git a/tests/test_calendar.py b/tests/test_calendar.py
--- a/tests/test_calendar.py
+++ b/tests/test_calendar.py
@@ -1,3 +1,7 @@
+import dates
+import dates.calendar
+dates.is_leap_year = dates.calendar.is_leap_year = lambda y: y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)
+
 from dates import days_in_month, is_leap_year


"""


def weakened_tests(task: dict) -> str:
    return (
        task["test_patch"]
        .replace("+    assert not is_leap_year(1900)\n", "+    assert True\n")
        .replace("+    assert days_in_month(1900, 2) == 28\n", "+    assert True\n")
    )


@pytest.mark.parametrize(
    "make_patch",
    [lambda task: MONKEYPATCHING_TESTS, weakened_tests],
    ids=["monkeypatching-the-tests", "weakening-the-tests"],
)
def test_editing_the_tests_instead_of_the_code_does_not_resolve(swe_task, make_patch):
    result = swe.score(swe_task, {"patch": make_patch(swe_task)})
    assert result.reward == 0.0 and result.details["stage"] == "tests-exited-1"
    assert result.details["FAIL_TO_PASS"] == {"passed": 0, "total": 2}
    assert result.details["PASS_TO_PASS"] == {"passed": 3, "total": 3}


def test_breaking_a_passing_test_does_not_resolve(swe_task):
    too_strict = swe_task["patch"].replace("(year % 100 != 0 or year % 400 == 0)", "year % 100 != 0")
    result = swe.score(swe_task, {"patch": too_strict})
    assert result.reward == 0.0
    assert result.details["tests"][json.loads(swe_task["FAIL_TO_PASS"])[0]] == "FAILED"


def test_the_workspace_is_the_repo_at_base_commit_without_later_history(swe_task, tmp_path):
    repo = Path(swe_task["repo_path"])
    head_before = git(repo, "rev-parse", "HEAD")
    prepared = swe.prepare(swe_task, tmp_path)
    assert prepared.tools == ("bash", "editor", "finish") and prepared.extra["repo_dir"] == "/workspace"
    assert git(tmp_path, "rev-parse", "HEAD").strip() == swe_task["base_commit"]
    assert len(git(tmp_path, "rev-list", "--all").split()) == 2
    with pytest.raises(subprocess.CalledProcessError):
        git(tmp_path, "cat-file", "-e", head_before.strip())
    assert git(repo, "rev-parse", "HEAD") == head_before and git(repo, "status", "--porcelain") == ""
    assert "is_leap_year(1900) returns True" in prepared.messages[-1]["content"]


def test_the_swe_artifact_is_the_diff_computed_inside_the_sandbox(swe_task, tmp_path, agent_sandbox):
    swe.prepare(swe_task, tmp_path)
    sandbox = agent_sandbox(tmp_path)
    hook = "#!/bin/sh\ntouch /workspace/hook-ran\n"
    sandbox.execute("editor", {"command": "create", "path": ".git/hooks/post-index-change", "file_text": hook}, 10)
    sandbox.execute("bash", {"command": "chmod +x .git/hooks/post-index-change"}, 10)
    sandbox.execute(
        "editor",
        {
            "command": "str_replace",
            "path": "dates/calendar.py",
            "old_str": "    return year % 4 == 0\n",
            "new_str": "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
        },
        10,
    )
    sandbox.execute("editor", {"command": "create", "path": "NOTES.md", "file_text": "century rule\n"}, 10)
    ran = sandbox.execute("bash", {"command": "python -m pytest -q -p no:cacheprovider 2>&1 | tail -1"}, 60)
    assert "3 passed" in ran["output"]

    artifact = swe.artifact(swe_task, "done", "", sandbox)
    patch = artifact["patch"]
    assert "+    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)" in patch
    assert "b/NOTES.md" in patch and "__pycache__" not in patch and "hooks" not in patch
    assert not (tmp_path / "hook-ran").exists()
    assert swe.score(swe_task, {"patch": patch}).reward == 1.0


@pytest.fixture(scope="module")
def outside_repo() -> Iterator[Path]:
    """A repository in a 0700 directory outside every allowed root (the secret another user keeps)."""
    secret = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="secret-"))
    task = make_swe_task(secret / "dates")
    yield Path(task["repo_path"])
    shutil.rmtree(secret)


def assert_refused_everywhere(task: dict, match: str = "ROLLOUT_REPO_ROOTS") -> None:
    """Refused at submission (validate), by the init worker (prepare) and by the grader (score)."""
    get_settings.cache_clear()
    with pytest.raises(ValidationError, match=r"task\.repo_path") as at_submission:
        swe.validate(task)
    assert match in at_submission.value.message
    with tempfile.TemporaryDirectory() as workspace, pytest.raises(ValidationError, match=match):
        swe.prepare(task, Path(workspace))
    with pytest.raises(ValidationError, match=match):
        swe.score(task, {"patch": task["patch"]})


@pytest.mark.parametrize("how", ["named directly", "through a symlink inside a root", "with .. out of a root"])
def test_a_swe_repo_path_outside_the_allowed_roots_is_refused_at_submission_init_and_eval(
    swe_task, outside_repo, tmp_path, how
):
    repo_path = {
        "named directly": str(outside_repo),
        "through a symlink inside a root": str(tmp_path / "link"),
        "with .. out of a root": f"{tmp_path}/{'../' * len(tmp_path.parts)}{str(outside_repo).lstrip('/')}",
    }[how]
    (tmp_path / "link").symlink_to(outside_repo)
    assert_refused_everywhere({**swe_task, "repo_path": repo_path})


def test_by_default_only_repositories_under_the_state_dir_but_not_job_workspaces_are_allowed(
    swe_task, tmp_path, monkeypatch
):
    monkeypatch.delenv("ROLLOUT_REPO_ROOTS")
    monkeypatch.setenv("ROLLOUT_STATE_DIR", str(tmp_path / "state"))
    inside = make_swe_task(tmp_path / "state" / "repos" / "dates")
    another_jobs_workspace = make_swe_task(tmp_path / "state" / "workspaces" / "job-1")
    get_settings.cache_clear()
    swe.validate(inside)
    assert swe.prepare(inside, tmp_path / "workspace").extra["repo_dir"] == "/workspace"
    assert_refused_everywhere(swe_task)
    assert_refused_everywhere(another_jobs_workspace, match="workspace")


def test_repo_roots_may_be_separated_by_the_path_separator_or_commas(swe_task, outside_repo, tmp_path, monkeypatch):
    for separator in (os.pathsep, ","):
        monkeypatch.setenv("ROLLOUT_REPO_ROOTS", f"{tmp_path}{separator}{outside_repo.parent}")
        get_settings.cache_clear()
        swe.validate({**swe_task, "repo_path": str(outside_repo)})


def artifact_files_in_host_tmp() -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in Path("/tmp").glob("rollout-artifact*")}


def test_swe_artifacts_extracted_in_local_sandboxes_leave_no_shared_file_on_the_host(swe_task, tmp_path):
    before = artifact_files_in_host_tmp()
    patches = []
    for n in range(2):
        workspace = tmp_path / f"w{n}"
        swe.prepare(swe_task, workspace)
        (workspace / f"change-{n}.txt").write_text(f"job {n}\n")
        with create_sandbox("local", SandboxSpec(f"job-{n}", str(workspace), tools=("bash",))) as sandbox:
            patches.append(swe.artifact(swe_task, None, "", sandbox)["patch"])
    assert "b/change-0.txt" in patches[0] and "b/change-1.txt" in patches[1] and "change-0" not in patches[1]
    assert artifact_files_in_host_tmp() == before


def test_an_image_swe_task_is_graded_by_the_harness_of_its_repo_and_version(swe_task, tmp_path):
    task = {**swe_task, "repo_path": None, "image": "docker://swebench/example:latest"}
    with pytest.raises(ValidationError, match="task.repo is required"):
        swe.validate(task)
    with pytest.raises(ValidationError, match="task.version '0.1' of django/django has no SWE-bench harness spec"):
        swe.validate({**task, "repo": "django/django", "version": "0.1"})
    swe.validate({**task, "test_cmd": "python -m pytest -rA"})  # or graded by its own command
    setup = swe.prepare(task, tmp_path)
    assert setup.image == task["image"] and not list(tmp_path.iterdir())  # the run node makes the sandbox
    assert setup.extra["pin_repo"] == ["/testbed", task["base_commit"]] and setup.extra["workdir"] == "/testbed"
    assert swe.prepares_cheaply_for(task) and not swe.prepares_cheaply_for(swe_task)


# -- examples -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.jsonl")), ids=lambda p: p.name)
def test_every_example_task_is_valid(path, swe_task):
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(lines) >= 1
    for task in lines:
        if task["domain"] == "swe":
            assert task["base_commit"] == swe_task["base_commit"]
            task = {**task, "repo_path": swe_task["repo_path"]}
        get_handler(task["domain"]).validate(task)


@pytest.mark.parametrize(
    "gold, answer, plain",
    [
        ("4", "\\boxed{4}", True),
        ("4", "$4$", True),
        ("4", "$\\boxed{4}$", True),
        ("29", "28", True),
        ("7", "-7", True),
        ("0", "-0", True),
        ("3", "3.0", True),
        ("0.5", "1/2", True),
        ("1234567891", "1234567890", True),
        ("0.1", "0.10000001", False),
        ("0.3333333", "1/3", False),
        ("1,000", "1000", False),
        ("4", "- 4", False),
        ("x + 1", "1 + x", False),
        ("12", "12.", False),
    ],
)
def test_plain_numbers_are_graded_without_math_verify_and_as_it_would(gold, answer, plain):
    from math_verify import parse, verify

    score = get_handler("math").score({"problem": "?", "answer": gold}, {"answer": answer})
    assert score.reward == float(verify(parse(f"${gold}$"), parse(answer)))
    assert (score.details.get("parsed_by") == "plain_number") == plain
