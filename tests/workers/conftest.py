"""Fixtures of the stage tests: the suite's service (tests/fixtures_service.py) with a scripted
backend of a model of the test's own, so stages resolve it whatever other tests registered."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_service.schemas import BackendView
from tests.fixtures_service import Service

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def model_name() -> str:
    return f"stage-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def scripted_model(scripted_backend: Callable[..., BackendView], model_name: str) -> Callable[[dict], BackendView]:
    """``scripted_model(script)``: a scripted backend serving ``model_name``."""
    return lambda script: scripted_backend(script, "vllm", model_name)


@pytest.fixture
def swe_task(service: Service) -> dict:
    """The example repository (examples/make_swe_repo.py) under the service's state directory, the
    one root repositories may be read from by default."""
    made = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "make_swe_repo.py"),
            str(service.state_dir / "repos" / uuid.uuid4().hex[:8] / "dates"),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    task = json.loads(made.stdout)
    task.pop("patch")  # the gold patch is for graders
    task["problem_statement"] += f" ({uuid.uuid4().hex[:6]})"  # a scripted episode matches this job only
    return task
