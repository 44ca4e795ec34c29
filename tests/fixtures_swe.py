"""Session fixture `swe_images`: real SWE-bench instances as OCI images (built without Docker).

It runs tests/swe_data/build.py into a persistent cache ($ROLLOUT_TEST_IMAGE_CACHE, default
~/.cache/rollout-service-tests/swe-images) and returns

    {instance_id: {"row": <the published row, untouched>, "image": "oci:<layout>:<tag>",
                   "layout": Path, "tag": str, "base_commit": str, "future_commit": str,
                   "future_refs": [...], "branch": str}}

The first build takes a few minutes (one mmdebstrap, one venv per instance); later sessions
reuse the cache, keyed by a hash of the builder and of each instance's data.  The instance
data is read from tests/swe_data/ or from $ROLLOUT_SWE_DATA when that is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BUILDER = Path(__file__).resolve().parent / "swe_data" / "build.py"
BUILD_TIMEOUT = 40 * 60


def swe_image_cache() -> Path:
    default = Path.home() / ".cache" / "rollout-service-tests" / "swe-images"
    return Path(os.environ.get("ROLLOUT_TEST_IMAGE_CACHE") or default).expanduser()


def swe_data_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_SWE_DATA") or BUILDER.parent).expanduser()


def swe_instance_ids() -> list[str]:
    data = swe_data_dir()
    if not data.is_dir():
        return []
    return sorted(p.name for p in data.iterdir() if (p / "row.json").is_file() and (p / "meta.json").is_file())


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def build_swe_images(instance_ids: list[str] | None = None) -> dict[str, dict]:
    cmd = [sys.executable, str(BUILDER), "--out", str(swe_image_cache()), "--data", str(swe_data_dir()),
           *(instance_ids or [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"building the SWE-bench images timed out after {BUILD_TIMEOUT}s: {' '.join(cmd)}\n"
                           f"{_tail((e.stderr or b'').decode(errors='replace') if isinstance(e.stderr, bytes) else (e.stderr or ''))}")
    if proc.returncode != 0:
        detail = proc.stderr
        try:
            err = json.loads(proc.stderr.strip().splitlines()[-1])
            detail = f"step {err.get('step')!r} failed (log: {err.get('log')}):\n{err.get('error')}"
        except (ValueError, IndexError):
            pass
        raise RuntimeError(f"building the SWE-bench images failed: {' '.join(cmd)}\n{_tail(detail, 80)}")
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["instance_id"]] = r
    images = {}
    for iid, r in results.items():
        row = json.loads((swe_data_dir() / iid / "row.json").read_text())
        images[iid] = {
            "row": row,
            "image": r["image"],
            "layout": Path(r["layout"]),
            "tag": r["tag"],
            "base_commit": r["base_commit"],
            "future_commit": r["future_commit"],
            "future_refs": r["future_refs"],
            "branch": r["branch"],
        }
    return images


@pytest.fixture(scope="session")
def swe_images() -> dict[str, dict]:
    ids = swe_instance_ids()
    if not ids:
        pytest.skip(f"no SWE-bench instance data in {swe_data_dir()} (set ROLLOUT_SWE_DATA)")
    try:
        return build_swe_images(ids)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
