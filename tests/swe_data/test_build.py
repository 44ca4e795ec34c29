"""Quick checks of the vendored SWE-bench instance data, and of one built image."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures_swe import swe_data_dir, swe_instance_ids
from tests.swe_data import build

ROW_FIELDS = [
    "repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
    "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit",
]
IDS = swe_instance_ids()
pytestmark = pytest.mark.skipif(not IDS, reason=f"no SWE-bench instance data in {swe_data_dir()}")


def load(iid: str) -> tuple[dict, dict, bytes]:
    d = swe_data_dir() / iid
    return (json.loads((d / "row.json").read_text()), json.loads((d / "meta.json").read_text()),
            (d / "base_commit.obj").read_bytes())


@pytest.mark.parametrize("iid", IDS)
def test_row_is_a_published_row(iid: str) -> None:
    row, meta, _ = load(iid)
    assert list(row) == ROW_FIELDS
    assert row["instance_id"] == iid == meta["instance_id"]
    assert all(isinstance(row[k], str) for k in ROW_FIELDS)
    fail_to_pass, pass_to_pass = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
    assert fail_to_pass and all(isinstance(t, str) and t for t in fail_to_pass)
    assert all(isinstance(t, str) and t for t in pass_to_pass)
    assert re.fullmatch(r"[0-9a-f]{40}", row["base_commit"])
    assert row["patch"].startswith("diff --git ") and row["test_patch"].startswith("diff --git ")


@pytest.mark.parametrize("iid", IDS)
def test_commit_object_is_base_commit(iid: str) -> None:
    row, meta, obj = load(iid)
    assert hashlib.sha1(b"commit %d\0" % len(obj) + obj).hexdigest() == row["base_commit"]
    assert re.search(rb"^tree ([0-9a-f]{40})$", obj, re.M).group(1).decode() == meta["tree"]
    assert [p.decode() for p in re.findall(rb"^parent ([0-9a-f]{40})$", obj, re.M)] == meta["parents"]


@pytest.mark.parametrize("iid", IDS)
def test_vendored_data_is_small(iid: str) -> None:
    d = swe_data_dir() / iid
    assert sum(p.stat().st_size for p in d.iterdir()) < 1_500_000
    _, meta, _ = load(iid)
    assert re.fullmatch(r"[0-9a-f]{64}", meta["sdist"]["sha256"])
    assert meta["test_cmd"] and meta["env"]["install"]


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


def test_built_image_has_the_repository_at_base_commit(swe_images: dict, tmp_path: Path) -> None:
    assert set(swe_images) == set(IDS)
    iid = "pallets__flask-4992" if "pallets__flask-4992" in swe_images else IDS[0]
    info = swe_images[iid]
    inspect = json.loads(subprocess.run(["skopeo", "inspect", "--config", info["image"]], check=True,
                                        capture_output=True, text=True).stdout)
    assert inspect["config"]["WorkingDir"] == "/testbed"
    assert any(e.startswith("PATH=/opt/miniconda3/bin:") for e in inspect["config"]["Env"])
    bundle = tmp_path / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{info['layout']}:{info['tag']}", bundle], check=True,
                   capture_output=True)
    script = (
        "source /opt/miniconda3/bin/activate && conda activate testbed && cd /testbed && "
        'echo "env=$CONDA_DEFAULT_ENV python=$(command -v python)" && git rev-parse HEAD && '
        "git status --porcelain --untracked-files=no && git log --all --format=%H"
    )
    out = subprocess.run(
        ["bwrap", "--bind", bundle / "rootfs", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net",
         "--clearenv", "--setenv", "HOME", "/root", "--setenv", "PATH", "/usr/bin:/bin", "bash", "-c", script],
        check=True, capture_output=True, text=True,
    ).stdout.splitlines()
    assert out[0] == "env=testbed python=/opt/miniconda3/envs/testbed/bin/python"
    assert out[1] == info["row"]["base_commit"]
    _, meta, _ = load(iid)
    # The history: the base commit, its parent(s) (the shallow boundary) and the one later commit.
    assert set(out[2:]) == {info["row"]["base_commit"], info["future_commit"], *meta["parents"]}
