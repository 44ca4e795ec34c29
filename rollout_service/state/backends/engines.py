"""HTTP to the engines: health probes, and pause, resume and weight reloads (vLLM's dev-mode RL
routes, SGLang's, the reference server's)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from rollout_service.schemas import BackendView, EngineResult

PROBE_THREADS = 32
PAUSE_MODES = ("keep", "wait", "abort")
ENGINE_RESUME_TIMEOUT_S = 30.0
_SGLANG_PAUSE_MODES = {"keep": "in_place", "wait": "in_place", "abort": "abort"}  # SGLang drains nothing itself

_health_clients: dict[int, httpx.Client] = {}


def _engine_client() -> httpx.Client:
    """This process's client for probes and control, made once (making one costs CPU for its SSL
    context). No kept-alive connections: a backend may close an idle one, and a probe must not read
    that as a miss."""
    client = _health_clients.get(os.getpid())
    if client is None:
        client = _health_clients[os.getpid()] = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
    return client


def answers_health(url: str, timeout_s: float) -> bool:
    """Whether the server at ``url`` answers its health probe now."""
    return _answers_health(_engine_client(), url.rstrip("/"), timeout_s)


def probe_engines(backends: list[BackendView], timeout_s: float) -> list[bool]:
    """GET {url}/health on every backend at once: whether each answered, in order."""
    if not backends:
        return []
    client = _engine_client()
    with ThreadPoolExecutor(min(PROBE_THREADS, len(backends))) as pool:
        return list(pool.map(lambda view: _answers_health(client, view.url, timeout_s), backends))


def _answers_health(client: httpx.Client, url: str, timeout_s: float) -> bool:
    try:
        return client.get(f"{url}/health", timeout=timeout_s).is_success
    except (httpx.HTTPError, httpx.InvalidURL, ValueError):
        return False


def control_engines(
    backends: list[BackendView], action: str, timeout_s: float, mode: str = "wait", model_path: str = ""
) -> list[EngineResult]:
    """Send ``action`` to every engine of ``backends`` at once; what each answered, in order (never raises)."""
    if not backends:
        return []
    client = _engine_client()
    with ThreadPoolExecutor(min(PROBE_THREADS, len(backends))) as pool:
        return list(pool.map(lambda view: _control_one(client, view, action, mode, model_path, timeout_s), backends))


def _control_request(
    kind: str, action: str, mode: str, model_path: str
) -> tuple[str, dict[str, str], dict[str, Any] | None]:
    """(path, query, JSON body) of ``action`` ("pause" | "resume" | "update_weights") on a ``kind`` engine."""
    if action == "pause":
        if kind == "sglang":
            return "/pause_generation", {}, {"mode": _SGLANG_PAUSE_MODES[mode]}
        return "/pause", {"mode": mode}, None
    if action == "resume":
        return ("/continue_generation", {}, {}) if kind == "sglang" else ("/resume", {}, None)
    if kind == "vllm":  # in place, from the directory, on every worker (vLLM's CPU build included)
        return "/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
    return "/update_weights_from_disk", {}, {"model_path": model_path}


def _control_error(kind: str, path: str, response: httpx.Response) -> str | None:
    if response.status_code == 404 and kind == "vllm":
        return (
            f"HTTP 404 from POST {path}: start vLLM with VLLM_SERVER_DEV_MODE=1 for its RL routes "
            "(/pause, /resume, /collective_rpc)"
        )
    if not response.is_success:
        return f"HTTP {response.status_code} from POST {path}: {response.text[:500]}"
    if path == "/update_weights_from_disk":  # SGLang answers 200 {"success": false, "message"} too
        try:
            answer = response.json()
        except ValueError:
            return f"POST {path} answered no JSON: {response.text[:300]}"
        if isinstance(answer, dict) and answer.get("success") is False:
            return f"POST {path}: {answer.get('message', answer)}"
    return None


def _control_one(
    client: httpx.Client, view: BackendView, action: str, mode: str, model_path: str, timeout_s: float
) -> EngineResult:
    path, params, payload = _control_request(view.kind, action, mode, model_path)
    started = time.monotonic()
    try:
        response = client.post(f"{view.url}{path}", params=params, json=payload, timeout=timeout_s)
        error = _control_error(view.kind, path, response)
    except httpx.TimeoutException:
        error = f"no answer to POST {path} within {timeout_s:g} s"
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
        error = f"POST {path} failed: {type(exc).__name__}: {exc}"
    return EngineResult(
        backend_id=view.id,
        url=view.url,
        kind=view.kind,
        ok=error is None,
        error=error,
        seconds=round(time.monotonic() - started, 3),
    )
