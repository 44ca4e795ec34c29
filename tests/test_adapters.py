"""Trainer adapters on trajectories recorded from real jobs (service, scripted LLM behind the
real protocol): each format gives back exactly the ids, the server's logprobs and the mask."""
from __future__ import annotations

import json
import uuid

import pytest

from rollout_service.adapters import adapter, to_openrlhf, to_slime, to_trl, to_verl
from rollout_service.schemas import FinishReason, Trajectory

PAD = 0


def tool_call(name: str, **arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture(scope="module")
def recorded(service, tmp_path_factory, tiny_tokenizer_dir) -> list[Trajectory]:
    """Two trajectories of different lengths: a tool-using episode (observation tokens masked
    out) and a one-turn plain answer."""
    from rollout_service.redis_server import free_port
    from rollout_service.reference_server import ReferenceServerProcess

    tag = uuid.uuid4().hex[:6]
    script = {"episodes": [
        {"match": f"Tools {tag}", "turns": ["Let me compute.\n" + tool_call("ipython", code="print(2 + 2)"),
                                             "It is \\boxed{4}.\n" + tool_call("finish", answer="\\boxed{4}")]},
        {"match": f"Plain {tag}", "turns": ["I believe it is \\boxed{5}."]},
    ]}
    directory = tmp_path_factory.mktemp("adapters")
    (directory / "script.json").write_text(json.dumps(script))
    server = ReferenceServerProcess(["--script", str(directory / "script.json"), "--tokenizer", str(tiny_tokenizer_dir)],
                                    port=free_port(), log_path=directory / "server.log").start()
    with service.client() as client:
        backend = client.add_backend(server.url, "vllm", f"adapters-{tag}", tokenizer=str(tiny_tokenizer_dir))
        try:
            ids = [client.submit({"domain": "math", "problem": f"{kind} {tag}", "answer": "4"},
                                 sampling={"model": f"adapters-{tag}"}).job_ids[0] for kind in ("Tools", "Plain")]
            views = client.wait(ids, timeout_s=120)
            assert [v.status.value for v in views] == ["completed", "completed"], [v.error for v in views]
            trajectories = [client.trajectory(i) for i in ids]
        finally:
            client.remove_backend(backend.id)
            server.stop()
    tools, plain = trajectories
    assert 0 in tools.loss_mask and set(plain.loss_mask) == {1}
    assert tools.reward == 1.0 and plain.reward == 0.0
    return trajectories


def test_verl_batch_pads_prompts_left_and_responses_right_and_gives_back_every_token(recorded):
    out = to_verl(recorded, pad_token_id=PAD)
    batch = out["batch"]
    width = batch["prompts"].shape[1]
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["position_ids"].shape
    for i, t in enumerate(recorded):
        prompt_part = batch["attention_mask"][i, :width].bool()
        response_part = batch["attention_mask"][i, width:].bool()
        assert batch["prompts"][i][prompt_part].tolist() == t.prompt_ids
        assert not prompt_part[: width - len(t.prompt_ids)].any()  # left padding
        assert batch["responses"][i][response_part].tolist() == t.response_ids
        assert batch["response_mask"][i][response_part].tolist() == t.loss_mask
        assert batch["rollout_log_probs"][i][response_part].tolist() == t.logprobs  # exact, float64
        assert batch["position_ids"][i][batch["attention_mask"][i].bool()].tolist() == list(
            range(len(t.prompt_ids) + len(t.response_ids)))
        scores = batch["token_level_scores"][i]
        assert scores[len(t.response_ids) - 1] == t.reward and scores.sum() == t.reward
    assert out["non_tensor_batch"]["reward"] == [1.0, 0.0]
    assert out["non_tensor_batch"]["finish_reason"] == ["finished", "no_tool_call"]


def test_trl_rollout_func_dict_is_the_trajectories_lists_unchanged(recorded):
    out = to_trl(recorded, rewards=[0.5, None])
    assert out["prompt_ids"] == [t.prompt_ids for t in recorded]
    assert out["completion_ids"] == [t.response_ids for t in recorded]
    assert out["logprobs"] == [t.logprobs for t in recorded]
    assert out["env_mask"] == [t.loss_mask for t in recorded]
    assert out["reward"] == [0.5, 0.0]  # an explicit reward wins, None falls back to the trajectory's


def test_slime_and_openrlhf_samples_split_back_into_prompt_and_response(recorded):
    for t in recorded:
        sample = to_slime(t)
        split = len(sample["tokens"]) - sample["response_length"]
        assert sample["tokens"][:split] == t.prompt_ids and sample["tokens"][split:] == t.response_ids
        assert sample["loss_mask"] == t.loss_mask and sample["rollout_log_probs"] == t.logprobs
        assert sample["status"] == "completed" and sample["reward"] == t.reward

        rlhf = to_openrlhf(t)
        split = rlhf["total_length"] - rlhf["response_length"]
        assert rlhf["sequences"][:split] == t.prompt_ids and rlhf["sequences"][split:] == t.response_ids
        assert rlhf["action_mask"] == t.loss_mask and rlhf["rollout_log_probs"] == t.logprobs


def test_a_truncated_episode_is_a_truncated_slime_sample_and_unknown_formats_are_listed(recorded):
    cut = recorded[1].model_copy(update={"truncated": True, "finish_reason": FinishReason.max_turns})
    assert to_slime(cut)["status"] == "truncated"
    assert adapter("verl") is to_verl
    with pytest.raises(ValueError, match="verl, trl, slime, openrlhf"):
        adapter("deepspeed-chat")
    with pytest.raises(ValueError, match="one per trajectory"):
        to_trl(recorded, rewards=[1.0])
