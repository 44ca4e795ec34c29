"""The GRPO example's loss reads trajectories as served: on-policy, its importance ratio is 1."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rollout_service.runtime.inference import make_client
from rollout_service.runtime.tokens import ChatRenderer, load_tokenizer
from rollout_service.schemas import Sampling, Trajectory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_grpo.py"


@pytest.fixture(scope="module")
def train_grpo():
    spec = importlib.util.spec_from_file_location("train_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trainers_logprobs_of_served_tokens_equal_the_servers_so_the_ratio_starts_at_one(
    train_grpo, model_server, tiny_model_dir
):
    import torch
    from transformers import AutoModelForCausalLM

    renderer = ChatRenderer(load_tokenizer(str(tiny_model_dir)))
    trajectories = []
    for question, seed in [("2 + 2 =", 1), ("Write a poem about the sea and the sky.", 2)]:
        prompt = renderer.initial_prompt([{"role": "user", "content": question}], [])
        served = make_client("vllm", model_server, "tiny").generate(prompt, Sampling(seed=seed), 12, 30)
        trajectories.append(
            Trajectory(
                prompt_ids=prompt,
                response_ids=served.token_ids,
                logprobs=served.logprobs,
                loss_mask=[1] * len(served.token_ids),
            )
        )
    assert len({len(t.prompt_ids) + len(t.response_ids) for t in trajectories}) == 2  # padding is exercised
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        new, old, mask = train_grpo.sequence_logprobs(model, trajectories)
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        assert old[i, :n].tolist() == pytest.approx(t.logprobs) and mask[i, :n].tolist() == [1.0] * n
        assert new[i, :n].tolist() == pytest.approx(t.logprobs, abs=1e-4)
        assert not mask[i, n:].any()
