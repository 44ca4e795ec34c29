"""A real vLLM (its CPU build, from `make vllm`) serving SmolLM2-135M-Instruct, started once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_service.devtools.engines import VLLMServer
from rollout_service.devtools.models import build_smollm2
from rollout_service.devtools.redis_server import free_port
from rollout_service.settings import get_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_smollm2(Path.home() / ".cache" / "rollout-service" / "smollm2")


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[VLLMServer]:
    """One vLLM server for the session (model name ``smollm2``); its log is in the session's tmp dir."""
    venv = Path(get_settings().vllm_venv)
    server = VLLMServer(
        venv if venv.is_absolute() else REPO / venv,
        smollm2_dir,
        "smollm2",
        free_port(),
        tmp_path_factory.mktemp("vllm") / "vllm.log",
    ).start()
    yield server
    server.stop()


ENGINE_TEST_TIMEOUT_S = 1200  # the first test also waits for vLLM's start (its compilation, on a busy 2-core machine)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kills_the_engine: kills the session's vLLM; runs after the other engine tests")
    config.addinivalue_line("markers", "own_engine: starts a vLLM of its own; runs once the session's is gone")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Engine tests last: the session's vLLM then starts after every other test, and its worker
    (which keeps a core busy while idle) does not slow them down. A test that kills it comes last of all."""
    here = Path(__file__).parent
    engine = [item for item in items if Path(str(item.fspath)).is_relative_to(here)]
    for item in engine:
        item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S))
    engine.sort(
        key=lambda item: (
            item.get_closest_marker("own_engine") is not None,
            item.get_closest_marker("kills_the_engine") is not None,
        )
    )
    items[:] = [item for item in items if item not in engine] + engine
