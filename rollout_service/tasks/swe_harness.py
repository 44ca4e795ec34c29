"""SWE-bench rows graded by the official harness itself: ``swebench==4.1.0`` used as a library.

Its specs (``MAP_REPO_VERSION_TO_SPECS``), eval-script maker, log parsers and resolution rule
are called as they are; nothing here re-writes them. 4.1.0 is the last release that ships the
per-repo specs and script makers (5.x moved them out of the package).

The package's ``__init__`` files import its Docker, Modal and dataset machinery, so the loader
registers bare package objects for ``swebench`` and ``swebench.harness`` (their ``__init__``
never runs) and imports only the submodules grading needs. ``harness/utils.py`` imports
``datasets`` and ``dotenv`` at the top and calls ``load_dotenv()`` on import; neither is used by
what we call, so stand-ins take their place while the harness loads (the real packages, if
installed, are left untouched in ``sys.modules`` afterwards): ``load_dotenv`` does nothing (no
``.env`` file is read into this process), anything else raises. ``requests`` and ``unidiff``
are the real packages (``unidiff`` parses the test patch's files).
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.machinery
import importlib.util
import json
import locale
import os
import sys
import tempfile
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_service.errors import TaskError, ValidationError

ENV_NAME = "testbed"
_STUBBED = ("datasets", "dotenv")
_load_lock = threading.Lock()


@dataclass(frozen=True)
class _Harness:
    constants: types.ModuleType
    grading: types.ModuleType
    create_scripts: types.ModuleType
    test_spec: types.ModuleType
    test_spec_python: types.ModuleType
    test_spec_utils: types.ModuleType
    root: Path


_harness: _Harness | None = None


class _Unavailable(types.ModuleType):
    """Stands in for a package the harness imports but grading never uses."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        module = self.__name__

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise TaskError(
                f"{module}.{name} is not available: rollout_service loads swebench without {module} "
                "(only the grading functions are used)"
            )

        return unavailable


def _dotenv_stand_in() -> types.ModuleType:
    module = _Unavailable("dotenv")
    module.load_dotenv = lambda *args, **kwargs: False  # type: ignore[attr-defined]
    return module


def _bare_package(name: str, path: Path) -> types.ModuleType:
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(path)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    return module


def _load() -> _Harness:
    global _harness
    with _load_lock:
        if _harness is not None:
            return _harness
        found = importlib.util.find_spec("swebench")
        if found is None or not found.submodule_search_locations:
            raise TaskError("the swebench package is not installed: pip install --no-deps swebench==4.1.0 unidiff")
        root = Path(next(iter(found.submodule_search_locations)))
        if "swebench" not in sys.modules:
            _bare_package("swebench", root)
        if "swebench.harness" not in sys.modules:
            _bare_package("swebench.harness", root / "harness")
        saved = {name: sys.modules.get(name) for name in _STUBBED}
        sys.modules["datasets"] = _Unavailable("datasets")
        sys.modules["dotenv"] = _dotenv_stand_in()
        try:
            _harness = _Harness(
                constants=importlib.import_module("swebench.harness.constants"),
                grading=importlib.import_module("swebench.harness.grading"),
                create_scripts=importlib.import_module("swebench.harness.test_spec.create_scripts"),
                test_spec=importlib.import_module("swebench.harness.test_spec.test_spec"),
                test_spec_python=importlib.import_module("swebench.harness.test_spec.python"),
                test_spec_utils=importlib.import_module("swebench.harness.test_spec.utils"),
                root=root,
            )
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
        return _harness


def _text_field(row: dict[str, Any], name: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value:
        raise ValidationError(f"task.{name} is required for a SWE-bench row (a non-empty string)")
    return value


def _test_list(row: dict[str, Any], name: str) -> list[str]:
    value = row.get(name, [])
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"task.{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, list) or not all(isinstance(test, str) for test in value):
        raise ValidationError(f"task.{name} must be a list of test names (or that list JSON-encoded)")
    return value


def _specs(row: dict[str, Any]) -> dict[str, Any]:
    by_version = _load().constants.MAP_REPO_VERSION_TO_SPECS
    repo = _text_field(row, "repo")
    if repo not in by_version:
        raise ValidationError(
            f"task.repo {repo!r} has no SWE-bench harness spec; known: {', '.join(sorted(by_version))}"
        )
    version = row.get("version")
    if not isinstance(version, str) or version not in by_version[repo]:
        raise ValidationError(
            f"task.version {version!r} of {repo} has no SWE-bench harness spec; known: {', '.join(by_version[repo])}"
        )
    specs: dict[str, Any] = by_version[repo][version]
    return specs


def spec(row: dict[str, Any]) -> dict[str, Any]:
    """The harness's spec (python, packages, install, test_cmd, ...) for the row's repo and version."""
    return copy.deepcopy(_specs(row))


def _instance(row: dict[str, Any]) -> dict[str, Any]:
    _specs(row)
    return {
        **row,
        "instance_id": row.get("instance_id") or "unknown",
        "base_commit": _text_field(row, "base_commit"),
        "test_patch": _text_field(row, "test_patch"),
    }


def test_command(row: dict[str, Any]) -> str:
    """The harness's test command for the row: for a Python repo the spec's test_cmd followed by
    the test patch's directives (django module labels, else file paths); elsewhere the spec's
    commands, which take none."""
    instance = _instance(row)
    harness = _load()
    if harness.constants.MAP_REPO_TO_EXT[row["repo"]] == "py":
        directives = harness.test_spec_python.get_test_directives(instance)
        return " ".join([_specs(row)["test_cmd"], *directives])
    return " && ".join(harness.test_spec_utils.get_test_cmds(instance))


def _test_spec(row: dict[str, Any], eval_script_list: list[str]) -> Any:
    harness = _load()
    return harness.test_spec.TestSpec(
        instance_id=row.get("instance_id") or "unknown",
        repo=row["repo"],
        version=row["version"],
        repo_script_list=[],
        eval_script_list=eval_script_list,
        env_script_list=[],
        arch="x86_64",
        FAIL_TO_PASS=_test_list(row, "FAIL_TO_PASS"),
        PASS_TO_PASS=_test_list(row, "PASS_TO_PASS"),
        language=harness.constants.MAP_REPO_TO_EXT[row["repo"]],
        docker_specs={},
        namespace=None,
    )


def eval_script(row: dict[str, Any], repo_dir: str = "/testbed") -> str:
    """The harness's eval script for the row, less the spec's re-install step (it needs the
    network; the image's editable install already tracks ``repo_dir``)."""
    instance = _instance(row)
    specs = _specs(row)
    base_commit = instance["base_commit"]
    try:
        commands: list[str] = list(
            _load().create_scripts.make_eval_script_list(
                instance, specs, ENV_NAME, repo_dir, base_commit, instance["test_patch"]
            )
        )
    except Exception as exc:  # unidiff rejects a malformed test patch
        raise ValidationError(f"task.test_patch: the SWE-bench harness cannot read it ({exc})") from exc
    install = specs.get("install")
    if isinstance(install, str):
        reset = next((i for i, c in enumerate(commands) if c.startswith(f"git checkout {base_commit}")), None)
        if reset is None or commands[reset - 1] != install:
            raise TaskError(
                f"the SWE-bench eval script of {row['repo']} {row['version']} has no install step before its test-file reset"
            )
        del commands[reset - 1]
    return str(_test_spec(row, commands).eval_script)


def apply_patch_commands() -> list[str]:
    """The harness's fallbacks for applying the model patch, in order; each takes the patch file's
    path as its last argument (the harness's ``GIT_APPLY_CMDS``, read from its source: the module
    that holds it imports docker)."""
    source = (_load().root / "harness" / "run_evaluation.py").read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GIT_APPLY_CMDS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise TaskError("swebench's run_evaluation.py has no GIT_APPLY_CMDS")


def test_statuses(row: dict[str, Any], log: str) -> dict[str, str]:
    """Each test's status in the eval script's output, by the harness's ``get_logs_eval``: the
    repo's parser on the text between the start/end markers (on the whole log when that part
    yields nothing). Empty when a marker is missing or the log holds one of the harness's failure
    lines (``>>>>> Patch Apply Failed``, ``>>>>> Reset Failed``, ``>>>>> Tests Errored``,
    ``>>>>> Tests Timed Out``)."""
    _specs(row)
    test_spec = _test_spec(row, [])
    # get_logs_eval reads a file with open()'s defaults: write what that read gives back
    encoding = locale.getpreferredencoding(False)
    fd, path = tempfile.mkstemp(prefix="swe-harness-", suffix=".log")
    try:
        with os.fdopen(fd, "w", encoding=encoding, errors="replace", newline="") as file:
            file.write(log)
        statuses, _found = _load().grading.get_logs_eval(test_spec, path)
    finally:
        os.unlink(path)
    return dict(statuses)


def resolution(row: dict[str, Any], statuses: dict[str, str]) -> dict[str, Any]:
    """The harness's report on the statuses: per FAIL_TO_PASS / PASS_TO_PASS test its status
    (``None`` when absent from the log), the harness's success/failure lists, and ``resolved``
    (RESOLVED_FULL)."""
    harness = _load()
    grading, constants = harness.grading, harness.constants
    _specs(row)
    expected = {name: _test_list(row, name) for name in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    eval_type = (
        constants.EvalType.FAIL_ONLY if row["repo"] in constants.FAIL_ONLY_REPOS else constants.EvalType.PASS_AND_FAIL
    )
    report = grading.get_eval_tests_report(statuses, expected, eval_type=eval_type)
    status = grading.get_resolution_status(report)
    return {
        "resolved": status == constants.ResolvedStatus.FULL.value,
        "status": status,
        **{
            name: {
                "tests": {test: statuses.get(test) for test in tests},
                "success": list(report[name]["success"]),
                "failure": list(report[name]["failure"]),
            }
            for name, tests in expected.items()
        },
    }
