"""vLLM's token route (/inference/v1/generate) and the sampling parameters, on a real vLLM: what the
service records is what vLLM computes, and each parameter the trainer sets takes effect."""

from __future__ import annotations

import math

import pytest

from rollout_service.devtools.engines import VLLMServer
from rollout_service.errors import ApiError
from rollout_service.runtime import inference
from rollout_service.runtime.inference import ReferenceClient, VLLMClient
from rollout_service.schemas import Sampling
from rollout_service.state.codec import unpack
from rollout_service.state.store import JobStore
from tests.helpers import math_task, vllm_rescored

EOS = 2  # SmolLM2's <|im_end|>
PROMPT = [1, 9690, 198, 2683, 314, 216, 34, 1232, 216, 34, 47, 2, 198]
TOLERANCE = 1e-4  # float32 on both sides: the same kernels, batched differently


def assert_close(recorded: list[float], expected: list[float]) -> None:
    assert len(recorded) == len(expected)
    assert all(math.isclose(a, b, abs_tol=TOLERANCE) for a, b in zip(recorded, expected)), (recorded, expected)


def test_the_token_route_returns_what_vllm_computes_and_what_completions_returns(vllm_engine: VLLMServer):
    sampling = Sampling(temperature=1.0, seed=11, repetition_penalty=1.3, presence_penalty=0.5, min_p=0.02)
    token_route = VLLMClient(vllm_engine.url, vllm_engine.model).generate(PROMPT, sampling, 24, 120)
    assert inference._vllm_routes[vllm_engine.url] == "generate"
    assert token_route.finish_reason in ("stop", "length") and token_route.token_ids
    assert_close(
        token_route.logprobs, vllm_rescored(vllm_engine, PROMPT, token_route.token_ids, timeout_s=120)
    )  # raw: before penalties
    completions = ReferenceClient(vllm_engine.url, vllm_engine.model).generate(PROMPT, sampling, 24, 120)
    assert (completions.token_ids, completions.logprobs) == (token_route.token_ids, token_route.logprobs)


def test_min_tokens_holds_the_eos_back_and_ignore_eos_generates_past_it(vllm_engine: VLLMServer):
    client = VLLMClient(vllm_engine.url, vllm_engine.model)
    eos_first = {str(EOS): 100.0}
    held = client.generate(PROMPT, Sampling(logit_bias=eos_first, min_tokens=8), 32, 120)
    assert len(held.token_ids) == 9 and EOS not in held.token_ids[:8] and held.token_ids[8] == EOS
    assert held.finish_reason == "stop"
    past = client.generate(PROMPT, Sampling(logit_bias=eos_first, ignore_eos=True), 12, 120)
    assert past.token_ids == [EOS] * 12 and past.finish_reason == "length"
    plain = client.generate(PROMPT, Sampling(logit_bias=eos_first), 12, 120)
    assert plain.token_ids == [EOS] and plain.finish_reason == "stop"


def test_a_logit_bias_of_100_makes_its_token_generated(vllm_engine: VLLMServer):
    generation = VLLMClient(vllm_engine.url, vllm_engine.model).generate(
        PROMPT, Sampling(logit_bias={"28": 100.0}, ignore_eos=True), 6, 120
    )
    assert generation.token_ids == [28] * 6


def test_a_jobs_sampling_reaches_vllm_is_recorded_with_the_job_and_its_logprobs_are_vllms(
    service, client, vllm_engine: VLLMServer, smollm2_dir
):
    backend = client.add_backend(vllm_engine.url, "vllm", vllm_engine.model, tokenizer=str(smollm2_dir))
    sampling = {
        "model": vllm_engine.model,
        "max_new_tokens": 10,
        "min_tokens": 10,
        "ignore_eos": True,
        "logit_bias": {"28": 100.0},
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.25,
        "min_p": 0.01,
        "temperature": 1.0,
    }
    try:
        (job_id,) = client.submit(math_task("What is 2 + 2?"), sampling=sampling, agent={"max_turns": 1}).job_ids
        (view,) = client.wait([job_id], timeout_s=300)
        assert view.status.value == "completed", (view.status, view.error)
        trajectory = client.trajectory(job_id)
        first = trajectory.turns[0]
        generated = trajectory.response_ids[first.start : first.end]
        assert generated == [28] * 10
        expected = vllm_rescored(vllm_engine, trajectory.prompt_ids, generated, timeout_s=120)
        assert_close(trajectory.logprobs[first.start : first.end], expected)
        stored = unpack(service.redis().get(JobStore.key(job_id, "request")))["sampling"]
        assert {key: stored[key] for key in sampling} == sampling
        with pytest.raises(ApiError, match=r"sampling\.min_p: must be in \[0, 1\], got 2"):
            client.submit(math_task("What is 2 + 2?"), sampling={**sampling, "min_p": 2})
    finally:
        client.remove_backend(backend.id)
