"""The service on a real vLLM: jobs complete, and what it records is what vLLM computed."""

from __future__ import annotations

import math

import httpx

from rollout_service.devtools.engines import VLLMServer
from tests.helpers import math_task


def test_math_jobs_on_vllm_complete_and_their_logprobs_are_vllms_own(
    service, client, vllm_engine: VLLMServer, smollm2_dir
):
    backend = client.add_backend(vllm_engine.url, "vllm", vllm_engine.model, tokenizer=str(smollm2_dir))
    try:
        job_ids = client.submit(
            math_task("What is 2 + 2? Answer in \\boxed{}."),
            n=2,
            sampling={"model": "smollm2", "max_new_tokens": 24, "temperature": 1.0},
            agent={"max_turns": 2, "tools": ["finish"]},
        ).job_ids
        views = client.wait(job_ids, timeout_s=300)
        assert all(v.status.value == "completed" for v in views), [(v.status, v.error) for v in views]
        for job_id in job_ids:
            trajectory = client.trajectory(job_id)
            assert trajectory.response_ids and trajectory.turns[0].backend_id == backend.id
            first = trajectory.turns[0]
            generated = trajectory.response_ids[first.start : first.end]
            rescored = httpx.post(
                f"{vllm_engine.url}/v1/completions",
                timeout=120,
                json={
                    "model": "smollm2",
                    "prompt": trajectory.prompt_ids + generated,
                    "max_tokens": 1,
                    "prompt_logprobs": 0,
                    "temperature": 1.0,
                },
            ).json()["choices"][0]["prompt_logprobs"]
            expected = [next(iter(entry.values()))["logprob"] for entry in rescored[len(trajectory.prompt_ids) :]]
            recorded = trajectory.logprobs[first.start : first.end]
            assert len(recorded) == len(expected)
            assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(recorded, expected)), (recorded, expected)
    finally:
        client.remove_backend(backend.id)
