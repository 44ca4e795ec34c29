"""Session fixture `swe_images`: SWE-bench instances as OCI images (built without Docker).

It runs tests/swe_data/build.py into a persistent cache ($ROLLOUT_TEST_IMAGE_CACHE, default
~/.cache/rollout-service-tests/swe-images) and returns

    {instance_id: {"row": <the row of row.json, untouched>, "image": "oci:<layout>:<tag>",
                   "layout": Path, "tag": str, "base_commit": str, "future_commit": str,
                   "future_refs": [...], "branch": str}}

The instances are those of $ROLLOUT_SWE_DATA, else tests/swe_data/ci: four instances authored
for CI from PyPI sdists, one per runner of the harness (see tests/swe_data/build.py).  The first
build takes a few minutes (one mmdebstrap, one venv per instance); later sessions reuse the
cache, keyed by a hash of the builder and of each instance's data.  A failed build fails the
fixture (with the step and the log's tail); it never skips.

``start_swe_image_build()`` starts the same build in the background (nice 10) and returns at
once, so that it overlaps other tests; the fixture then waits for it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

BUILDER = Path(__file__).resolve().parent / "swe_data" / "build.py"
CI_DATA = BUILDER.parent / "ci"
BUILD_TIMEOUT = 40 * 60


def swe_image_cache() -> Path:
    default = Path.home() / ".cache" / "rollout-service-tests" / "swe-images"
    return Path(os.environ.get("ROLLOUT_TEST_IMAGE_CACHE") or default).expanduser()


def swe_data_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_SWE_DATA") or CI_DATA).expanduser().resolve()


def swe_instance_ids() -> list[str]:
    data = swe_data_dir()
    if not data.is_dir():
        return []
    return sorted(p.name for p in data.iterdir() if (p / "row.json").is_file() and (p / "meta.json").is_file())


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _build_cmd(instance_ids: list[str]) -> list[str]:
    return [sys.executable, str(BUILDER), "--out", str(swe_image_cache()), "--data", str(swe_data_dir()), *instance_ids]


class _Build:
    """A builder process writing its stdout/stderr to files."""

    def __init__(self, instance_ids: list[str], niceness: int = 0):
        self.instance_ids = list(instance_ids)
        self.cmd = _build_cmd(self.instance_ids)
        self.dir = Path(tempfile.mkdtemp(prefix="swe-image-build-"))
        self.out, self.err = self.dir / "stdout", self.dir / "stderr"
        self.started = time.monotonic()
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                (["nice", "-n", str(niceness)] if niceness else []) + self.cmd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def stop(self) -> None:
        """End the build if it still runs (its process group: the builder and its tools)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def wait(self) -> dict[str, dict]:
        try:
            self.proc.wait(timeout=max(1.0, BUILD_TIMEOUT - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(
                f"building the SWE-bench images timed out after {BUILD_TIMEOUT}s: "
                f"{' '.join(self.cmd)}\n{_tail(self.err.read_text(errors='replace'))}"
            ) from None
        stdout = self.out.read_text(errors="replace")
        stderr = self.err.read_text(errors="replace")
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.proc.returncode != 0:
            detail = stderr
            try:
                err = json.loads(stderr.strip().splitlines()[-1])
                detail = f"step {err.get('step')!r} failed (log: {err.get('log')}):\n{err.get('error')}"
            except (ValueError, IndexError, AttributeError):
                pass
            raise RuntimeError(
                f"building the SWE-bench images failed (exit {self.proc.returncode}): "
                f"{' '.join(self.cmd)}\n{_tail(detail, 80)}"
            )
        results = {}
        for line in stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                results[r["instance_id"]] = r
        missing = sorted(set(self.instance_ids) - set(results))
        if missing:
            raise RuntimeError(
                f"the SWE-bench image build printed no result for {missing}: {' '.join(self.cmd)}\n"
                f"{_tail(stdout + stderr)}"
            )
        return results


_background: _Build | None = None


def start_swe_image_build() -> None:
    """Start building the images of swe_instance_ids() into the cache in the background (nice 10)
    and return at once; the swe_images fixture waits for it.  No-op when already started or
    when there is no instance data (the fixture then fails)."""
    global _background
    ids = swe_instance_ids()
    if _background is not None or not ids:
        return
    _background = _Build(ids, niceness=10)
    atexit.register(_background.stop)  # a session that ends before the fixture: no orphan build


def build_swe_images(instance_ids: list[str] | None = None) -> dict[str, dict]:
    """Build (or take from the cache) the images and return them as the fixture does; waits for
    the background build when one was started for the same instances."""
    global _background
    ids = list(instance_ids or swe_instance_ids())
    if _background is not None and _background.cmd == _build_cmd(ids):
        build, _background = _background, None
    else:
        build = _Build(ids)
    results = build.wait()
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
        pytest.fail(f"no SWE-bench instance data in {swe_data_dir()} (ROLLOUT_SWE_DATA)", pytrace=False)
    try:
        return build_swe_images(ids)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
