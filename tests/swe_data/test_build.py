"""Quick checks of the SWE-bench instance data (tests/swe_data/ci, or $ROLLOUT_SWE_DATA), and of one
built image."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rollout_service.tasks import swe_harness
from tests.fixtures_swe import swe_data_dir, swe_instance_ids
from tests.swe_data import build

ROW_FIELDS = [
    "repo",
    "instance_id",
    "base_commit",
    "patch",
    "test_patch",
    "problem_statement",
    "hints_text",
    "created_at",
    "version",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "environment_setup_commit",
]
CI_RUNNERS = {  # the CI instances: one per test runner of the harness
    "django__django-90001": "./tests/runtests.py",
    "sympy__sympy-90001": "bin/test",
    "pallets__flask-90001": "pytest",
    "pytest-dev__pytest-90001": "pytest",
}
IDS = swe_instance_ids()


def load(iid: str) -> tuple[dict, dict]:
    d = swe_data_dir() / iid
    return json.loads((d / "row.json").read_text()), json.loads((d / "meta.json").read_text())


def test_the_ci_instances_cover_every_runner() -> None:
    assert sorted(p.name for p in build.DEFAULT_DATA.iterdir() if p.is_dir()) == sorted(CI_RUNNERS)
    for iid, runner in CI_RUNNERS.items():
        row = json.loads((build.DEFAULT_DATA / iid / "row.json").read_text())
        assert row["instance_id"] == iid
        assert runner in swe_harness.test_command(row).split()


def test_the_ci_data_holds_nothing_but_our_own_files() -> None:
    allowed = {"row.json", "meta.json", "bug.patch"}
    for d in build.DEFAULT_DATA.iterdir():
        files = [p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()]
        assert all(f in allowed or f.startswith("files/") for f in files), files
        assert json.loads((d / "meta.json").read_text())["kind"] == "authored"
        assert sum((d / f).stat().st_size for f in files) < 50_000


@pytest.mark.parametrize("iid", IDS)
def test_row_is_in_the_published_format(iid: str) -> None:
    row, meta = load(iid)
    assert list(row) == ROW_FIELDS
    assert row["instance_id"] == iid == meta["instance_id"] and row["repo"] == meta["repo"]
    assert all(isinstance(row[k], str) for k in ROW_FIELDS)
    fail_to_pass, pass_to_pass = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
    assert fail_to_pass and all(isinstance(t, str) and t for t in fail_to_pass)
    assert all(isinstance(t, str) and t for t in pass_to_pass) and not set(fail_to_pass) & set(pass_to_pass)
    assert re.fullmatch(r"[0-9a-f]{40}", row["base_commit"])
    assert row["patch"].startswith("diff --git ") and row["test_patch"].startswith("diff --git ")
    assert swe_harness.spec(row)["test_cmd"]
    assert meta["sdist"]["filename"] and re.fullmatch(r"[0-9a-f]{64}", meta["sdist"]["sha256"])


@pytest.mark.parametrize("iid", [i for i in IDS if i in CI_RUNNERS])
def test_an_authored_instance_is_a_py311_release_plus_our_bug(iid: str) -> None:
    row, meta = load(iid)
    assert swe_harness.spec(row)["python"] == meta["env"]["harness_python"]
    assert meta["env"]["python"] == "3.11"
    bug = (swe_data_dir() / iid / "bug.patch").read_text()
    changed = lambda patch: re.findall(r"^diff --git a/(\S+) ", patch, re.M)  # noqa: E731
    assert changed(bug) == changed(row["patch"])  # the gold patch touches what the bug did, no test file
    assert not set(changed(row["test_patch"])) & set(changed(bug))
    # the gold patch is the bug reversed: its removed lines are the bug's added ones
    minus = lambda patch, sign: [l[1:] for l in patch.splitlines() if l[:1] == sign and l[:3] != sign * 3]  # noqa: E731,E741
    assert minus(bug, "+") == minus(row["patch"], "-") and minus(bug, "-") == minus(row["patch"], "+")


def test_image_tag_follows_the_harness_rule() -> None:
    assert build.image_tag("django__django-16400") == "sweb.eval.x86_64.django_1776_django-16400"
    assert build.image_tag("pytest-dev__pytest-11143") == "sweb.eval.x86_64.pytest-dev_1776_pytest-11143"


def test_recipe_key_follows_the_data(tmp_path: Path) -> None:
    src = swe_data_dir() / IDS[0]
    copy = tmp_path / IDS[0]
    shutil.copytree(src, copy)
    key = build.instance_key(copy)
    assert build.instance_key(copy) == key
    (copy / "meta.json").write_text((copy / "meta.json").read_text() + " ")
    assert build.instance_key(copy) != key


def test_the_builder_extracts_no_code_from_a_clone() -> None:
    source = Path(build.__file__).read_text()
    assert "def prepare" not in source and '"prepare"' not in source


def test_built_image_has_the_repository_at_base_commit(swe_images: dict, tmp_path: Path) -> None:
    assert set(swe_images) == set(IDS)
    iid = "pallets__flask-90001" if "pallets__flask-90001" in swe_images else IDS[0]
    info = swe_images[iid]
    inspect = json.loads(
        subprocess.run(
            ["skopeo", "inspect", "--config", info["image"]], check=True, capture_output=True, text=True
        ).stdout
    )
    assert inspect["config"]["WorkingDir"] == "/testbed"
    assert any(e.startswith("PATH=/opt/miniconda3/bin:") for e in inspect["config"]["Env"])
    bundle = tmp_path / "bundle"
    subprocess.run(
        ["umoci", "raw", "unpack", "--image", f"{info['layout']}:{info['tag']}", bundle],
        check=True,
        capture_output=True,
    )
    script = (
        "source /opt/miniconda3/bin/activate && conda activate testbed && cd /testbed && "
        'echo "env=$CONDA_DEFAULT_ENV python=$(command -v python)" && git rev-parse HEAD && '
        "git status --porcelain --untracked-files=no && git log --all --format=%H"
    )
    out = subprocess.run(
        [
            "bwrap",
            "--bind",
            bundle,
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--unshare-net",
            "--clearenv",
            "--setenv",
            "HOME",
            "/root",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "bash",
            "-c",
            script,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert out[0] == "env=testbed python=/opt/miniconda3/envs/testbed/bin/python"
    assert out[1] == info["row"]["base_commit"]
    stamp = json.loads((Path(info["layout"]).parent / "stamps" / f"{iid}.json").read_text())["result"]
    # The history: the base commit, its parent(s) and the one later commit (the gold fix).
    assert set(out[2:]) == {info["row"]["base_commit"], info["future_commit"], *stamp["parents"]}
