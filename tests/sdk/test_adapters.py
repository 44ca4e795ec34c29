"""Trainer adapters on trajectories recorded from real jobs (service, scripted LLM behind the
real protocol), loaded by the trainers' own code: verl 0.9.1's ``DataProto`` and reward/advantage
functions, OpenRLHF 0.11.2's ``Experience`` built by its own ``_process_response_into_experience``
(taken from the installed module's source: the module itself imports vLLM at the top), TRL 1.16's
``rollout_func`` keys, and a mirror of slime's ``Sample`` (slime is not on PyPI). Every segment of
a multi-segment (history-rewriting harness) trajectory becomes a sample of its own."""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from rollout_service.errors import TrainerFormatError
from rollout_service.schemas import FinishReason, Trajectory
from rollout_service.sdk.adapters import adapter, segments_of, to_openrlhf, to_slime, to_trl, to_verl
from tests.helpers import TOOL_LOOP_HARNESS

PAD = 0
PROMPT_LENGTH, RESPONSE_LENGTH = 512, 256


def tool_call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def recorded(service, tmp_path_factory, tiny_tokenizer_dir) -> list[Trajectory]:
    """Three trajectories: a tool-using episode (observation tokens masked out), a one-turn plain
    answer, and a harness episode that rewrote its history (two segments)."""
    from rollout_service.devtools.redis_server import free_port
    from rollout_service.devtools.reference_server import ReferenceServerProcess

    tag = uuid.uuid4().hex[:6]
    script = {
        "episodes": [
            {"match": "REWRITE-MARKER", "turns": ["Summary: 4"]},
            {
                "match": f"Tools {tag}",
                "turns": [
                    "Let me compute.\n" + tool_call("ipython", code="print(2 + 2)"),
                    "It is \\boxed{4}.\n" + tool_call("finish", answer="\\boxed{4}"),
                ],
            },
            {"match": f"Plain {tag}", "turns": ["I believe it is \\boxed{5}."]},
            {
                "match": f"Harness {tag}",
                "turns": [
                    "Let me check.\n" + tool_call("shell", command="echo hi"),
                    tool_call("shell", command="python -c 'print(2 + 2)'"),
                    "The answer is \\boxed{4}.",
                ],
            },
        ]
    }
    directory = tmp_path_factory.mktemp("adapters")
    (directory / "script.json").write_text(json.dumps(script))
    server = ReferenceServerProcess(
        ["--script", str(directory / "script.json"), "--tokenizer", str(tiny_tokenizer_dir)],
        port=free_port(),
        log_path=directory / "server.log",
    ).start()
    with service.client() as client:
        backend = client.add_backend(server.url, "vllm", f"adapters-{tag}", tokenizer=str(tiny_tokenizer_dir))
        try:
            fields: dict[str, Any] = {"sampling": {"model": f"adapters-{tag}"}}
            ids = [
                client.submit({"domain": "math", "problem": f"{kind} {tag}", "answer": "4"}, **fields).job_ids[0]
                for kind in ("Tools", "Plain")
            ]
            ids += client.submit(
                {"domain": "math", "problem": f"Harness {tag}", "answer": "4"},
                **fields,
                agent={"harness": {"command": ["python", "-c", TOOL_LOOP_HARNESS]}},
            ).job_ids
            views = client.wait(ids, timeout_s=120)
            assert [v.status.value for v in views] == ["completed"] * 3, [v.error for v in views]
            trajectories = [client.trajectory(i) for i in ids]
        finally:
            client.remove_backend(backend.id)
            server.stop()
    tools, plain, harness = trajectories
    assert 0 in tools.loss_mask and set(plain.loss_mask) == {1}
    assert tools.reward == 1.0 and plain.reward == 0.0 and harness.reward == 1.0
    assert len(harness.segments) == 1 and harness.segments[0].response_ids  # the summary call: a second segment
    return trajectories


def every_segment(trajectories: list[Trajectory]) -> list[tuple[int, int, Any]]:
    return [(i, j, s) for i, t in enumerate(trajectories) for j, s in enumerate(segments_of(t))]


def test_every_adapter_keeps_every_segment_of_a_rewritten_history_or_refuses_it(recorded):
    rows = every_segment(recorded)
    assert len(rows) == 4
    generated = sum(sum(s.loss_mask) for _, _, s in rows)

    verl = to_verl(recorded, PAD, PROMPT_LENGTH, RESPONSE_LENGTH)
    assert verl["batch"]["responses"].shape[0] == 4
    assert int(verl["batch"]["response_mask"].sum()) == generated
    assert verl["non_tensor_batch"]["segment_index"].tolist() == [0, 0, 0, 1]
    slime = to_slime(recorded)
    assert [s["tokens"][-s["response_length"] :] for s in slime] == [s.response_ids for _, _, s in rows]
    assert sum(sum(s["loss_mask"]) for s in slime) == generated
    openrlhf = to_openrlhf(recorded)
    assert sum(end - start for s in openrlhf for start, end in s["action_ranges"]) == generated
    assert [(s["trajectory_index"], s["segment_index"]) for s in openrlhf] == [(i, j) for i, j, _ in rows]

    with pytest.raises(TrainerFormatError, match="trajectory 2 has 2 segments.*one completion per prompt"):
        to_trl(recorded)


def test_verl_loads_the_batch_as_a_dataproto_reads_its_rewards_and_concatenates_chunks(recorded):
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.reward import extract_reward

    rows = every_segment(recorded)
    chunks = [
        DataProto.from_dict(
            **dict(
                zip(
                    ("tensors", "non_tensors", "meta_info"), to_verl(part, PAD, PROMPT_LENGTH, RESPONSE_LENGTH).values()
                )
            )
        )
        for part in (recorded[:1], recorded[1:])
    ]
    data = DataProto.concat(chunks)
    assert len(data) == 4
    batch = data.batch
    assert batch["input_ids"].shape == (4, PROMPT_LENGTH + RESPONSE_LENGTH)
    assert batch["rollout_log_probs"].dtype == torch.float32
    for row, (_, _, segment) in enumerate(rows):
        prompt_part = batch["attention_mask"][row, :PROMPT_LENGTH].bool()
        response_part = batch["attention_mask"][row, PROMPT_LENGTH:].bool()
        assert batch["prompts"][row][prompt_part].tolist() == segment.prompt_ids
        assert not prompt_part[: PROMPT_LENGTH - len(segment.prompt_ids)].any()  # left padding
        assert batch["responses"][row][response_part].tolist() == segment.response_ids
        assert batch["response_mask"][row][response_part].tolist() == segment.loss_mask
        assert torch.equal(
            batch["rollout_log_probs"][row][response_part], torch.tensor(segment.logprobs, dtype=torch.float32)
        )
        assert batch["position_ids"][row][batch["attention_mask"][row].bool()].tolist() == list(
            range(len(segment.prompt_ids) + len(segment.response_ids))
        )
    assert data.non_tensor_batch["__num_turns__"].tolist() == [len(s.turns) for _, _, s in rows]
    assert data.non_tensor_batch["trajectory_index"].tolist() == [0, 0, 1, 1]  # per chunk
    assert data.non_tensor_batch["truncated"].tolist() == [False] * 4

    rewards, _ = extract_reward(data)
    assert rewards.sum(dim=1).tolist() == [1.0, 0.0, 1.0, 1.0]  # both segments carry the episode's reward
    assert [float(rewards[row, len(s.response_ids) - 1]) for row, (_, _, s) in enumerate(rows)] == [1.0, 0.0, 1.0, 1.0]
    advantages, _ = compute_grpo_outcome_advantage(rewards, batch["response_mask"], np.array(["a", "a", "b", "b"]))
    assert advantages[0][batch["response_mask"][0].bool()].unique().tolist() == pytest.approx([0.7071], abs=1e-4)


def test_verl_refuses_a_segment_longer_than_its_fixed_widths_and_takes_group_uids(recorded):
    longest = max(len(s.response_ids) for _, _, s in every_segment(recorded))
    with pytest.raises(TrainerFormatError, match=f"response_length={longest - 1}.*raise them"):
        to_verl(recorded, PAD, PROMPT_LENGTH, longest - 1)
    out = to_verl(recorded, PAD, PROMPT_LENGTH, RESPONSE_LENGTH, uids=["g1", "g1", "g2"])
    assert out["non_tensor_batch"]["uid"].tolist() == ["g1", "g1", "g2", "g2"]
    with pytest.raises(TrainerFormatError, match="one per trajectory"):
        to_verl(recorded, PAD, PROMPT_LENGTH, RESPONSE_LENGTH, uids=["g1"])


def openrlhf_process_response() -> Any:
    """OpenRLHF's own ``SamplesGenerator._process_response_into_experience``, compiled from the
    installed module's source with the names it uses (the module imports vLLM at its top)."""
    import openrlhf
    import torch
    from openrlhf.trainer.ppo_utils import experience

    source = (Path(openrlhf.__file__).parent / "trainer/ppo_utils/samples_generator.py").read_text()
    module = ast.parse(source)
    generator = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "SamplesGenerator")
    method = next(
        n for n in generator.body if isinstance(n, ast.FunctionDef) and n.name == "_process_response_into_experience"
    )
    namespace: dict[str, Any] = {"torch": torch, "Experience": experience.Experience}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "samples_generator.py", "exec"), namespace)
    return namespace["_process_response_into_experience"]


def test_openrlhf_builds_its_experiences_from_the_samples_with_actions_and_logprobs_in_place(recorded):
    import torch

    process = openrlhf_process_response()
    rows = every_segment(recorded)
    for sample, (i, _, segment) in zip(to_openrlhf(recorded, prompts=["p0", "p1", "p2"]), rows):
        exp = process(None, sample, max_len=4096)
        n_prompt = len(segment.prompt_ids)
        assert exp.sequences[0].tolist() == segment.prompt_ids + segment.response_ids
        # OpenRLHF's action_mask and rollout_log_probs are shifted by one: position k scores token k + 1
        assert exp.action_mask[0, n_prompt - 1 :].tolist() == segment.loss_mask
        assert not exp.action_mask[0, : n_prompt - 1].any()
        assert torch.equal(exp.rollout_log_probs[0, n_prompt - 1 :], torch.tensor(segment.logprobs))
        assert exp.rewards.tolist() == [recorded[i].reward] and exp.prompts == [f"p{i}"]
        assert exp.truncated.tolist() == [False]


@dataclasses.dataclass
class SlimeSample:
    """A mirror of slime's ``slime.utils.types.Sample`` (the fields the adapter fills and
    ``from_dict``'s status conversion): slime is installed from its git repository, not PyPI."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: Any = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    status: SlimeSample.Status = Status.PENDING
    metadata: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def from_dict(data: dict) -> SlimeSample:
        data = {**data, "status": SlimeSample.Status(data["status"])}
        names = {f.name for f in dataclasses.fields(SlimeSample)}
        sample = SlimeSample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample


def test_slime_samples_load_with_response_aligned_masks_and_the_policy_versions(recorded):
    rows = every_segment(recorded)
    for doc, (i, j, segment) in zip(to_slime(recorded, labels=["4", "4", "4"]), rows):
        sample = SlimeSample.from_dict(doc)
        split = len(sample.tokens) - sample.response_length
        assert sample.tokens[:split] == segment.prompt_ids and sample.tokens[split:] == segment.response_ids
        assert sample.loss_mask == segment.loss_mask and len(sample.loss_mask) == sample.response_length
        assert sample.rollout_log_probs == segment.logprobs  # exact
        assert sample.status is SlimeSample.Status.COMPLETED and sample.reward == recorded[i].reward
        generations = [t for t in segment.turns if t.kind == "generation"]
        served = {t.policy_version for t in recorded[i].turns if t.kind == "generation"}
        assert len(served) == 1 and None not in served  # the version the service served when it ran them
        assert sample.weight_versions == [str(served.pop())] * len(generations)
        assert sample.metadata["segment_index"] == j and sample.label == "4"
        assert sample.prompt and sample.prompt[-1]["role"] == "user"


def test_trl_rollout_func_dict_is_the_trajectories_lists_unchanged(recorded):
    from trl.trainer.grpo_trainer import GRPOTrainer

    single = recorded[:2]
    out = to_trl(single, rewards=[0.5, None])
    assert {"prompt_ids", "completion_ids", "logprobs"} <= out.keys() and GRPOTrainer  # TRL's required keys
    assert out["prompt_ids"] == [t.prompt_ids for t in single]
    assert out["completion_ids"] == [t.response_ids for t in single]
    assert out["logprobs"] == [t.logprobs for t in single]
    assert out["env_mask"] == [t.loss_mask for t in single]
    assert out["reward"] == [0.5, 0.0]  # an explicit reward wins, None falls back to the trajectory's


def test_a_truncated_episode_is_marked_on_its_last_segment_and_unknown_formats_are_listed(recorded):
    cut = recorded[2].model_copy(update={"truncated": True, "finish_reason": FinishReason.max_turns})
    assert [s["status"] for s in to_slime([cut])] == ["completed", "truncated"]
    assert [s["truncated"] for s in to_openrlhf([cut])] == [False, True]
    verl = to_verl([cut], PAD, PROMPT_LENGTH, RESPONSE_LENGTH)
    assert verl["non_tensor_batch"]["truncated"].tolist() == [False, True]
    assert adapter("verl") is to_verl
    with pytest.raises(ValueError, match="verl, trl, slime, openrlhf"):
        adapter("deepspeed-chat")
    with pytest.raises(ValueError, match="one per trajectory"):
        to_trl(recorded[:2], rewards=[1.0])
