"""SWE-bench rows graded by the official harness (swebench 4.1.0) loaded without Docker, Modal or datasets.

The rows are published SWE-bench rows (django__django-10914, sympy__sympy-20590,
pytest-dev__pytest-8906) with their PASS_TO_PASS lists cut to a few tests. The runner logs marked
"captured" are real output of django's tests/runtests.py (Django 4.2.16 sdist), sympy's test
runner (sympy 1.12, what bin/test calls) and pytest -rA (pytest 9.2) on small probe test modules,
run under Python 3.11; the others follow the same formats with the rows' own test names.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from rollout_service.errors import ValidationError
from rollout_service.tasks import swe_harness

START, END = ">>>>> Start Test Output", ">>>>> End Test Output"

DJANGO_ROW = {
    "repo": "django/django",
    "instance_id": "django__django-10914",
    "base_commit": "e7fd69d051eaa67cb17f172a39b57253e9cb831a",
    "version": "3.0",
    "environment_setup_commit": "419a78300f7cd27611196e1e464d50fd0385ff27",
    "test_patch": (
        "diff --git a/tests/test_utils/tests.py b/tests/test_utils/tests.py\n"
        "--- a/tests/test_utils/tests.py\n"
        "+++ b/tests/test_utils/tests.py\n"
        "@@ -1099,7 +1099,7 @@ def test_override_file_upload_permissions(self):\n"
        "         the file_permissions_mode attribute of\n"
        "         django.core.files.storage.default_storage.\n"
        '         """\n'
        "-        self.assertIsNone(default_storage.file_permissions_mode)\n"
        "+        self.assertEqual(default_storage.file_permissions_mode, 0o644)\n"
        "         with self.settings(FILE_UPLOAD_PERMISSIONS=0o777):\n"
        "             self.assertEqual(default_storage.file_permissions_mode, 0o777)\n"
        " \n"
    ),
    "FAIL_TO_PASS": '["test_override_file_upload_permissions (test_utils.tests.OverrideSettingsTests)"]',
    "PASS_TO_PASS": json.dumps(
        [
            "test_override_media_root (test_utils.tests.OverrideSettingsTests)",
            "assertRaisesMessage shouldn't interpret RE special chars.",
            "test_skip_if_db_feature (test_utils.tests.SkippingTestCase)",
        ]
    ),
}

SYMPY_ROW = {
    "repo": "sympy/sympy",
    "instance_id": "sympy__sympy-20590",
    "base_commit": "cffd4e0f86fefd4802349a9f9b19ed70934ea354",
    "version": "1.7",
    "test_patch": (
        "diff --git a/sympy/core/tests/test_basic.py b/sympy/core/tests/test_basic.py\n"
        "--- a/sympy/core/tests/test_basic.py\n"
        "+++ b/sympy/core/tests/test_basic.py\n"
        "@@ -34,6 +34,12 @@ def test_structure():\n"
        "     assert bool(b1)\n"
        " \n"
        " \n"
        "+def test_immutable():\n"
        "+    assert not hasattr(b1, '__dict__')\n"
        "+    with raises(AttributeError):\n"
        "+        b1.x = 1\n"
        "+\n"
        "+\n"
        " def test_equality():\n"
        "     instances = [b1, b2, b3, b21, Basic(b1, b1, b1), Basic]\n"
        "     for i, b_i in enumerate(instances):\n"
    ),
    "FAIL_TO_PASS": ["test_immutable"],
    "PASS_TO_PASS": ["test__aresame", "test_structure", "test_equality"],
}

PYTEST_ROW = {
    "repo": "pytest-dev/pytest",
    "instance_id": "pytest-dev__pytest-8906",
    "base_commit": "69356d20cfee9a81972dcbf93d8caf9eabe113e8",
    "version": "7.0",
    "environment_setup_commit": "e2ee3144ed6e241dea8d96215fcdca18b3892551",
    "test_patch": (
        "diff --git a/testing/test_skipping.py b/testing/test_skipping.py\n"
        "--- a/testing/test_skipping.py\n"
        "+++ b/testing/test_skipping.py\n"
        "@@ -1341,7 +1341,7 @@ def test_func():\n"
        "     )\n"
        "     result = pytester.runpytest()\n"
        "     result.stdout.fnmatch_lines(\n"
        '-        ["*Using pytest.skip outside of a test is not allowed*"]\n'
        '+        ["*Using pytest.skip outside of a test will skip the entire module*"]\n'
        "     )\n"
        " \n"
        " \n"
    ),
    "FAIL_TO_PASS": '["testing/test_skipping.py::test_module_level_skip_error"]',
    "PASS_TO_PASS": json.dumps(
        [
            "testing/test_skipping.py::test_importorskip",
            "testing/test_skipping.py::TestXFail::test_xfail_simple[True]",
            "testing/test_skipping.py::test_relpath_rootdir",
        ]
    ),
}

# captured: Django 4.2.16's tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 swe_probe.tests
DJANGO_CAPTURED = """\
Testing against Django installed in '/tmp/swb/capv/lib/python3.11/site-packages/django'
Importing application swe_probe
Found 6 test(s).
Skipping setup of unused database(s): default, other.
System check identified no issues (0 silenced).
test_docstring (swe_probe.tests.ProbeTests.test_docstring)
A test with a docstring prints its first line. ... ok
test_errors (swe_probe.tests.ProbeTests.test_errors) ... ERROR
test_expected_failure (swe_probe.tests.ProbeTests.test_expected_failure) ... expected failure
test_fails (swe_probe.tests.ProbeTests.test_fails) ... FAIL
test_passes (swe_probe.tests.ProbeTests.test_passes) ... ok
test_skipped (swe_probe.tests.ProbeTests.test_skipped) ... skipped 'not on this backend'

======================================================================
ERROR: test_errors (swe_probe.tests.ProbeTests.test_errors)
----------------------------------------------------------------------
Traceback (most recent call last):
  File "/tmp/swb/sd/Django-4.2.16/tests/swe_probe/tests.py", line 14, in test_errors
    raise RuntimeError("boom")
RuntimeError: boom

======================================================================
FAIL: test_fails (swe_probe.tests.ProbeTests.test_fails)
----------------------------------------------------------------------
Traceback (most recent call last):
  File "/tmp/swb/sd/Django-4.2.16/tests/swe_probe/tests.py", line 11, in test_fails
    self.assertEqual(1 + 1, 3)
AssertionError: 2 != 3

----------------------------------------------------------------------
Ran 6 tests in 0.004s

FAILED (failures=1, errors=1, skipped=1, expected failures=1)
"""

# captured: sympy 1.12's runner, verbose and without the cache (bin/test -C --verbose)
SYMPY_CAPTURED = """\
============================= test process starts ==============================
executable:         /tmp/swb/capv/bin/python  (3.11.7-final-0) [CPython]
architecture:       64-bit
cache:              no
ground types:       python\x20
numpy:              None
random seed:        12800296
hash randomization: on (PYTHONHASHSEED=3234167304)

sympy/core/tests/test_swe_probe.py[5]\x20
test_passes ok
test_fails F
test_errors E
test_skipped not on this platform s
test_expected_failure f                                                   [FAIL]


________________________________________________________________________________
________________ sympy/core/tests/test_swe_probe.py:test_errors ________________
Traceback (most recent call last):
  File "/tmp/swb/capv/lib/python3.11/site-packages/sympy/core/tests/test_swe_probe.py", line 14, in test_errors
    raise RuntimeError("boom")
RuntimeError: boom

________________________________________________________________________________
________________ sympy/core/tests/test_swe_probe.py:test_fails _________________
Traceback (most recent call last):
  File "/tmp/swb/capv/lib/python3.11/site-packages/sympy/core/tests/test_swe_probe.py", line 10, in test_fails
    assert Symbol('x') == Symbol('y')
           ^^^^^^^^^^^^^^^^^^^^^^^^^^
AssertionError

 tests finished: 1 passed, 1 failed, 1 skipped, 1 expected to fail,\x20
1 exceptions, in 0.22 seconds\x20
DO *NOT* COMMIT!
"""

# captured: pytest 9.2 -rA (the summary part)
PYTEST_CAPTURED = """\
==================================== PASSES ====================================
=================================== XPASSES ====================================
=========================== short test summary info ============================
PASSED testing/test_probe.py::test_passes
PASSED testing/test_probe.py::test_param[c]
SKIPPED [1] testing/test_probe.py:21: not here
XFAIL testing/test_probe.py::test_xfails - known bug
XPASS testing/test_probe.py::test_xpasses - fixed already
ERROR testing/test_probe.py::test_errors - RuntimeError: fixture boom
FAILED testing/test_probe.py::test_fails - AssertionError: one is not two
FAILED testing/test_probe.py::test_param[a b] - AssertionError: assert 'a b' ...
==== 2 failed, 2 passed, 1 skipped, 1 xfailed, 1 xpassed, 1 error in 0.09s =====
"""


def eval_log(row: dict, test_output: str) -> str:
    """What the eval script prints: set -x echoes its commands, the markers are ':' commands."""
    return (
        f"+ git checkout {row['base_commit']} tests\n+ git apply -v -\nApplied patch cleanly.\n"
        f"+ : '{START}'\n+ {swe_harness.test_command(row)}\n{test_output}+ : '{END}'\n"
        f"+ git checkout {row['base_commit']} tests\n"
    )


def script_lines(script: str) -> list[str]:
    return script.splitlines()


def test_the_spec_is_the_harness_spec_for_the_rows_repo_and_version():
    specs = swe_harness.spec(DJANGO_ROW)
    assert specs["test_cmd"] == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
    assert specs["install"] == "python -m pip install -e ."
    specs["test_cmd"] = "changed"
    assert swe_harness.spec(DJANGO_ROW)["test_cmd"] != "changed"


def test_an_unknown_version_is_refused_naming_the_field_and_the_known_versions():
    with pytest.raises(
        ValidationError, match=r"task\.version '9\.9' of django/django has no SWE-bench harness spec; known: .*3\.0"
    ):
        swe_harness.spec({**DJANGO_ROW, "version": "9.9"})


def test_an_unknown_repo_is_refused_naming_the_field():
    with pytest.raises(
        ValidationError, match=r"task\.repo 'someone/else' has no SWE-bench harness spec; known: .*django/django"
    ):
        swe_harness.eval_script({**DJANGO_ROW, "repo": "someone/else"})


def test_a_missing_test_patch_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match=r"task\.test_patch"):
        swe_harness.eval_script({**DJANGO_ROW, "test_patch": ""})


def test_the_eval_script_is_the_harness_script_without_its_install_step():
    row = DJANGO_ROW
    script = swe_harness.eval_script(row)
    harness_lines = importlib.import_module("swebench.harness.test_spec.create_scripts").make_eval_script_list(
        row, swe_harness.spec(row), "testbed", "/testbed", row["base_commit"], row["test_patch"]
    )
    assert "python -m pip install -e ." in harness_lines
    assert (
        script
        == "\n".join(
            ["#!/bin/bash", "set -uxo pipefail", *[c for c in harness_lines if c != "python -m pip install -e ."]]
        )
        + "\n"
    )
    assert "pip install" not in script


def test_the_django_eval_script_resets_applies_and_runs_the_test_module_labels_between_the_markers():
    lines = script_lines(swe_harness.eval_script(DJANGO_ROW, repo_dir="/work/repo"))
    reset = "git checkout e7fd69d051eaa67cb17f172a39b57253e9cb831a tests/test_utils/tests.py"
    command = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 test_utils.tests"
    assert lines[2:5] == ["source /opt/miniconda3/bin/activate", "conda activate testbed", "cd /work/repo"]
    assert lines.count(reset) == 2
    start, end = lines.index(f": '{START}'"), lines.index(f": '{END}'")
    assert lines.index(reset) < lines.index("git apply -v - <<'EOF_114329324912'") < start
    assert lines[start + 1 : end] == [command]
    assert lines[-1] == reset
    assert swe_harness.test_command(DJANGO_ROW) == command


def test_the_sympy_and_pytest_eval_scripts_run_the_test_patchs_files():
    assert swe_harness.test_command(SYMPY_ROW) == (
        "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose sympy/core/tests/test_basic.py"
    )
    assert swe_harness.test_command(PYTEST_ROW) == "pytest -rA testing/test_skipping.py"
    for row in (SYMPY_ROW, PYTEST_ROW):
        script = swe_harness.eval_script(row)
        assert swe_harness.test_command(row) + "\n" in script
        assert swe_harness.spec(row)["install"] not in script


def test_the_model_patch_is_applied_with_the_harness_fallbacks():
    assert swe_harness.apply_patch_commands() == [
        "git apply --verbose",
        "git apply --verbose --reject",
        "patch --batch --fuzz=5 -p1 -i",
    ]


def test_django_runner_output_is_read_by_the_harness_parser():
    statuses = swe_harness.test_statuses(DJANGO_ROW, eval_log(DJANGO_ROW, DJANGO_CAPTURED))
    assert statuses["test_passes (swe_probe.tests.ProbeTests.test_passes)"] == "PASSED"
    assert statuses["test_fails (swe_probe.tests.ProbeTests.test_fails)"] == "FAILED"
    assert statuses["test_errors (swe_probe.tests.ProbeTests.test_errors)"] == "ERROR"
    assert statuses["test_skipped (swe_probe.tests.ProbeTests.test_skipped)"] == "SKIPPED"
    # a test with a docstring is named by the docstring's first line, as in the dataset's lists
    assert statuses["A test with a docstring prints its first line."] == "PASSED"
    # the harness has no "expected failure" status for django: such a test is absent (a failure)
    assert not any("test_expected_failure" in name for name in statuses)
    # and it also records the FAIL:/ERROR: headers under the bare method name
    assert statuses["test_fails"] == "FAILED" and statuses["test_errors"] == "ERROR"


def test_a_django_row_is_resolved_when_its_fail_to_pass_and_pass_to_pass_tests_pass():
    passing = (
        "test_override_file_upload_permissions (test_utils.tests.OverrideSettingsTests) ... ok\n"
        "test_override_media_root (test_utils.tests.OverrideSettingsTests) ... ok\n"
        "test_assert_raises_message (test_utils.tests.AssertRaisesMsgTest) ... ok\n"
        "assertRaisesMessage shouldn't interpret RE special chars. ... ok\n"
        "test_skip_if_db_feature (test_utils.tests.SkippingTestCase) ... ok\n"
        "\n----------------------------------------------------------------------\n"
        "Ran 5 tests in 0.113s\n\nOK\n"
    )
    report = swe_harness.resolution(DJANGO_ROW, swe_harness.test_statuses(DJANGO_ROW, eval_log(DJANGO_ROW, passing)))
    assert report["resolved"] is True and report["status"] == "RESOLVED_FULL"
    assert report["FAIL_TO_PASS"]["failure"] == [] and report["PASS_TO_PASS"]["failure"] == []

    failing = passing.replace(
        "test_override_file_upload_permissions (test_utils.tests.OverrideSettingsTests) ... ok",
        "test_override_file_upload_permissions (test_utils.tests.OverrideSettingsTests) ... FAIL",
    )
    report = swe_harness.resolution(DJANGO_ROW, swe_harness.test_statuses(DJANGO_ROW, eval_log(DJANGO_ROW, failing)))
    assert report["resolved"] is False and report["status"] == "RESOLVED_NO"
    assert report["FAIL_TO_PASS"] == {
        "tests": {"test_override_file_upload_permissions (test_utils.tests.OverrideSettingsTests)": "FAILED"},
        "success": [],
        "failure": ["test_override_file_upload_permissions (test_utils.tests.OverrideSettingsTests)"],
    }


def test_sympy_runner_output_is_read_by_the_harness_parser():
    statuses = swe_harness.test_statuses(SYMPY_ROW, eval_log(SYMPY_ROW, SYMPY_CAPTURED))
    assert statuses["test_passes"] == "PASSED"
    assert statuses["test_fails"] == "FAILED"
    assert statuses["test_errors"] == "ERROR"
    # the traceback headers are recorded as failures under path:name
    assert statuses["sympy/core/tests/test_swe_probe.py:test_errors"] == "FAILED"
    # sympy's skip (" s") and XFAIL (" f") lines match none of the parser's endings: absent
    assert "test_skipped" not in statuses and "test_expected_failure" not in statuses


def test_a_sympy_row_is_resolved_when_its_tests_print_ok():
    output = (
        "sympy/core/tests/test_basic.py[5] \ntest__aresame ok\ntest_structure ok\ntest_immutable ok\n"
        "test_equality ok\ntest_canonical_variables ok                                                  [OK]\n\n"
        "================== tests finished: 5 passed, in 0.05 seconds ===================\n"
    )
    statuses = swe_harness.test_statuses(SYMPY_ROW, eval_log(SYMPY_ROW, output))
    assert swe_harness.resolution(SYMPY_ROW, statuses)["resolved"] is True
    # a file's last test shares its line with the file's [OK]: the parser does not see it
    assert "test_canonical_variables" not in statuses

    broken = output.replace("test_immutable ok", "test_immutable F")
    statuses = swe_harness.test_statuses(SYMPY_ROW, eval_log(SYMPY_ROW, broken))
    report = swe_harness.resolution(SYMPY_ROW, statuses)
    assert report["resolved"] is False and report["FAIL_TO_PASS"]["failure"] == ["test_immutable"]


def test_pytest_summary_lines_are_read_by_the_harness_parser():
    statuses = swe_harness.test_statuses(PYTEST_ROW, eval_log(PYTEST_ROW, PYTEST_CAPTURED))
    assert statuses["testing/test_probe.py::test_passes"] == "PASSED"
    assert statuses["testing/test_probe.py::test_fails"] == "FAILED"
    assert statuses["testing/test_probe.py::test_errors"] == "ERROR"
    assert statuses["testing/test_probe.py::test_xfails"] == "XFAIL"
    # XPASS is not one of the harness's statuses; a SKIPPED line names no test id, only its count
    assert "testing/test_probe.py::test_xpasses" not in statuses
    assert statuses["[1]"] == "SKIPPED"


def test_a_pytest_row_counts_xfail_as_a_pass_and_a_failure_or_absence_as_a_failure():
    f2p = "testing/test_skipping.py::test_module_level_skip_error"
    p2p = json.loads(PYTEST_ROW["PASS_TO_PASS"])
    summary = f"PASSED {f2p}\nPASSED {p2p[0]}\nXFAIL {p2p[1]} - reason\nPASSED {p2p[2]}\n"
    statuses = swe_harness.test_statuses(PYTEST_ROW, eval_log(PYTEST_ROW, summary))
    assert swe_harness.resolution(PYTEST_ROW, statuses)["resolved"] is True

    statuses = swe_harness.test_statuses(PYTEST_ROW, eval_log(PYTEST_ROW, summary.replace(f"PASSED {p2p[2]}\n", "")))
    report = swe_harness.resolution(PYTEST_ROW, statuses)
    assert report["resolved"] is False
    assert report["PASS_TO_PASS"]["failure"] == [p2p[2]] and report["PASS_TO_PASS"]["tests"][p2p[2]] is None


def test_a_skipped_test_is_neither_a_pass_nor_a_failure_and_drops_out_of_the_count():
    """The harness's rule: success/(success+failure), a SKIPPED test in neither list, and an empty
    list counting as 1 — so a row whose only FAIL_TO_PASS test was skipped is resolved."""
    f2p = "testing/test_skipping.py::test_module_level_skip_error"
    statuses = {f2p: "SKIPPED", **{test: "PASSED" for test in json.loads(PYTEST_ROW["PASS_TO_PASS"])}}
    report = swe_harness.resolution(PYTEST_ROW, statuses)
    assert report["FAIL_TO_PASS"]["success"] == [] and report["FAIL_TO_PASS"]["failure"] == []
    assert report["resolved"] is True


def test_the_test_lists_may_be_lists_or_json_strings():
    statuses = {
        "test_immutable": "PASSED",
        "test__aresame": "PASSED",
        "test_structure": "PASSED",
        "test_equality": "PASSED",
    }
    as_json = {**SYMPY_ROW, "FAIL_TO_PASS": '["test_immutable"]', "PASS_TO_PASS": json.dumps(SYMPY_ROW["PASS_TO_PASS"])}
    assert swe_harness.resolution(as_json, statuses) == swe_harness.resolution(SYMPY_ROW, statuses)
    with pytest.raises(ValidationError, match=r"task\.FAIL_TO_PASS"):
        swe_harness.resolution({**SYMPY_ROW, "FAIL_TO_PASS": "not json"}, statuses)


def test_a_log_missing_a_marker_or_reporting_a_failed_patch_has_no_statuses():
    log = eval_log(SYMPY_ROW, "test_immutable ok\n")
    assert swe_harness.test_statuses(SYMPY_ROW, log) == {"test_immutable": "PASSED"}
    assert swe_harness.test_statuses(SYMPY_ROW, log.replace(END, "")) == {}
    assert swe_harness.test_statuses(SYMPY_ROW, ">>>>> Patch Apply Failed:\nerror: patch failed\n" + log) == {}
    assert swe_harness.resolution(SYMPY_ROW, {})["resolved"] is False


def test_when_nothing_parses_between_the_markers_the_whole_log_is_read():
    log = f"test_immutable ok\n+ : '{START}'\nno tests ran\n+ : '{END}'\n"
    assert swe_harness.test_statuses(SYMPY_ROW, log) == {"test_immutable": "PASSED"}


def test_loading_the_harness_imports_neither_docker_nor_modal_nor_datasets():
    probe = (
        "import sys\n"
        "from rollout_service.tasks import swe_harness\n"
        "swe_harness.eval_script(ROW)\n"
        "swe_harness.apply_patch_commands()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'docker', 'modal', 'datasets', 'dotenv'})\n"
        "assert not heavy, heavy\n"
        "assert 'swebench.harness.docker_build' not in sys.modules and 'swebench.harness.grading' in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", f"ROW = {DJANGO_ROW!r}\n{probe}"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
