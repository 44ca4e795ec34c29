"""Token-level fixtures: the offline tiny tokenizer/model, and reference inference servers
(scripted or with the tiny model) running as real subprocesses over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from rollout_service.devtools.redis_server import free_port
from rollout_service.devtools.reference_server import ReferenceServerProcess
from rollout_service.devtools.tiny_model import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny") / "tokenizer")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def scripted_server(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Iterator[Callable[..., str]]:
    """``scripted_server(script, *extra_args) -> url``: a reference server replaying ``script``
    with the tiny tokenizer; stopped after the test."""
    servers: list[ReferenceServerProcess] = []

    def start(script: dict, *extra_args: str) -> str:
        directory = tmp_path_factory.mktemp("scripted")
        script_path = directory / "script.json"
        script_path.write_text(json.dumps(script))
        server = ReferenceServerProcess(
            ["--script", str(script_path), "--tokenizer", str(tiny_tokenizer_dir), *extra_args],
            port=free_port(),
            log_path=directory / "server.log",
        )
        servers.append(server)
        return server.start().url

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def model_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    """URL of a reference server generating with the tiny random-weight model."""
    server = ReferenceServerProcess(
        ["--model", str(tiny_model_dir)],
        port=free_port(),
        log_path=tmp_path_factory.mktemp("model-server") / "server.log",
    ).start()
    yield server.url
    server.stop()


def logged_requests(url: str) -> list[dict]:
    """What a reference server received and returned, oldest first."""
    response = httpx.get(f"{url}/debug/requests", timeout=10)
    response.raise_for_status()
    return response.json()
