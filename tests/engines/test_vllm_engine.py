"""The service on a real vLLM: jobs complete, and what it records is what vLLM computed."""

from __future__ import annotations

import math

from rollout_service.devtools.engines import VLLMServer
from tests.helpers import math_task, vllm_rescored


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
            expected = vllm_rescored(vllm_engine, trajectory.prompt_ids, generated, timeout_s=120)
            recorded = trajectory.logprobs[first.start : first.end]
            assert len(recorded) == len(expected)
            assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(recorded, expected)), (recorded, expected)
    finally:
        client.remove_backend(backend.id)
