"""A cancelled job, or one whose deadline cuts its LLM call, frees the engine: vLLM stops the request
when the service closes the call's connection (its routes abort on a client's disconnect), seen in
``vllm:num_requests_running`` on its /metrics."""

from __future__ import annotations

import re
import time

import httpx

from rollout_service.devtools.engines import VLLMServer
from rollout_service.state.store import JobStore
from tests.helpers import math_task

FREED_WITHIN_S = 2.0
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}  # minutes of generation on 2 cores


def running(engine: VLLMServer) -> float:
    metrics = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", metrics, re.M))


def wait_running(engine: VLLMServer, at_least: bool, timeout_s: float) -> float:
    """When ``running(engine)`` was first seen >= 1 (``at_least``) or 0, polling every 50 ms."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (running(engine) >= 1) == at_least:
            return time.time()
        time.sleep(0.05)
    raise AssertionError(
        f"vllm:num_requests_running never went {'>= 1' if at_least else 'to 0'} within {timeout_s:g} s"
    )


def test_cancelling_a_job_mid_generation_stops_its_request_in_vllm(client, vllm_engine: VLLMServer, smollm2_dir):
    backend = client.add_backend(vllm_engine.url, "vllm", vllm_engine.model, tokenizer=str(smollm2_dir))
    try:
        (job_id,) = client.submit(
            math_task("What is 2 + 2?"), sampling={"model": vllm_engine.model, **LONG}, agent={"max_turns": 1}
        ).job_ids
        wait_running(vllm_engine, True, 120)
        time.sleep(1)
        cancelled_at = time.time()
        client.cancel(job_id)
        freed_at = wait_running(vllm_engine, False, 30)
        assert freed_at - cancelled_at < FREED_WITHIN_S
        (view,) = client.wait([job_id], timeout_s=60)
        assert view.status.value == "cancelled"
    finally:
        client.remove_backend(backend.id)


def test_a_deadline_that_cuts_a_call_stops_its_request_in_vllm(service, client, vllm_engine: VLLMServer, smollm2_dir):
    backend = client.add_backend(vllm_engine.url, "vllm", vllm_engine.model, tokenizer=str(smollm2_dir))
    try:
        (job_id,) = client.submit(
            math_task("What is 2 + 2?"),
            sampling={"model": vllm_engine.model, **LONG},
            agent={"max_turns": 1},
            timeouts={"job_s": 8},
        ).job_ids
        wait_running(vllm_engine, True, 120)
        freed_at = wait_running(vllm_engine, False, 60)
        deadline_at = float(service.redis().hget(JobStore.key(job_id), "deadline_at"))
        assert -0.5 < freed_at - deadline_at < FREED_WITHIN_S
        (view,) = client.wait([job_id], timeout_s=60)
        assert view.finish_reason is not None and view.finish_reason.value == "deadline", view
    finally:
        client.remove_backend(backend.id)
