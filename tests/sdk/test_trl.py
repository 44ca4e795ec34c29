"""TRL 1.16's GRPOTrainer trains the tiny model on rollouts from the service (real gateway, Celery
workers, bwrap sandboxes, a reference engine serving the same weights): the weight-sync callback
pushes each step's weights, so every step's rollouts come from the policy being trained."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from rollout_service.errors import TrainerFormatError
from rollout_service.sdk.trl import ServiceRollouts, logprob_gap, service_reward, task_prompt


def distinct_characters(completions: list[str], **_: Any) -> list[float]:
    """A reward that differs between the random model's completions, so every step has a gradient."""
    return [len(set(c)) / 10.0 for c in completions]


@pytest.fixture
def engine(tmp_path, tiny_model_dir):
    """A reference engine on a private copy of the tiny model (the test changes its weights)."""
    from rollout_service.devtools.redis_server import free_port
    from rollout_service.devtools.reference_server import ReferenceServerProcess

    weights = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    server = ReferenceServerProcess(
        ["--model", str(weights)], port=free_port(), log_path=tmp_path / "engine.log"
    ).start()
    yield server.url, weights
    server.stop()


def test_grpo_trainer_pushes_weights_every_step_and_the_rollouts_stay_on_policy(service, engine, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    url, weights = engine
    name = f"trl-{uuid.uuid4().hex[:6]}"
    tasks = [
        {"domain": "math", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
        for a, b in [(2, 3), (4, 5), (6, 1), (7, 2)]
    ]
    outputs: list[dict[str, Any]] = []
    with service.client() as client:
        backend = client.add_backend(url, "reference", name, tokenizer=str(weights))
        client.pause()
        base = client.resume(policy_version=max(b.policy_version for b in client.backends()) + 3)["policy_version"]
        try:
            rollouts = ServiceRollouts(
                client,
                tasks,
                model=name,
                sync_dir=tmp_path / "sync",
                check_logprobs=True,
                sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12},
                agent={"max_turns": 1, "tools": []},
                timeouts={"job_s": 120},
            )

            def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
                outputs.append(rollouts(prompts, trainer))
                return outputs[-1]

            torch.manual_seed(0)
            trainer = GRPOTrainer(
                model=AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32),
                processing_class=AutoTokenizer.from_pretrained(weights),
                reward_funcs=[service_reward, distinct_characters],
                args=GRPOConfig(
                    output_dir=str(tmp_path / "out"),
                    per_device_train_batch_size=4,
                    num_generations=4,
                    max_completion_length=12,
                    max_steps=2,
                    learning_rate=5e-3,
                    logging_steps=1,
                    save_strategy="no",
                    report_to="none",
                    use_cpu=True,
                    bf16=False,
                    disable_tqdm=True,
                    seed=0,
                ),
                train_dataset=rollouts.dataset(),
                rollout_func=rollout_func,
                callbacks=[rollouts.weight_sync()],
            )
            trainer.train()
            served = {b.id: b for b in client.backends()}[backend.id]
        finally:
            client.remove_backend(backend.id)

    steps = [row for row in trainer.state.log_history if "rollout/wall_s" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert [(row["rollout/policy_version_min"], row["rollout/policy_version_max"]) for row in steps] == [
        (base, base),
        (base + 1, base + 1),
    ]
    assert [row["sync/policy_version"] for row in steps] == [base + 1, base + 2] and served.policy_version == base + 2
    for row in steps:
        assert row["rollout/logprob_gap_max"] < 1e-4  # importance ratio exp(gap) within 1e-4 of 1, every step
        assert row["rollout/run_s"] > 0 and row["sync/update_s"] > 0 and row["rollout/failed"] == 0
    assert len(outputs) == 2 and all(len(out["completion_ids"]) == 4 for out in outputs)
    # the steps moved the weights far enough that a missing sync would show in the gap
    assert logprob_gap(trainer.model, outputs[0]) > 0.05


def test_rollouts_refuse_prompts_that_are_not_their_tasks_and_tasks_sharing_a_prompt(service):
    task = {"domain": "math", "problem": "1 + 1?", "answer": "2"}
    with service.client() as client:
        rollouts = ServiceRollouts(client, [task])
        assert rollouts.dataset()["prompt"] == ["1 + 1?"] and task_prompt(task) == "1 + 1?"
        with pytest.raises(TrainerFormatError, match="not one of this ServiceRollouts' tasks"):
            rollouts(["2 + 2?"], trainer=None)
        with pytest.raises(TrainerFormatError, match="share the prompt"):
            ServiceRollouts(client, [task, {**task, "answer": "3"}])
    with pytest.raises(TrainerFormatError, match="prompt_of="):
        task_prompt({"domain": "math", "text": "1 + 1?"})
