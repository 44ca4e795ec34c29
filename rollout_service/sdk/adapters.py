"""Trajectories in the shapes RL trainers consume: pure functions, nothing re-tokenized.

A trajectory holds one or more segments (an external harness that rewrote its history started
a new one; ``Trajectory.segments`` after the top-level first). Every segment is a training
sample of its own, carrying its trajectory's reward, ``trajectory_index`` and ``segment_index``;
a format that cannot hold several samples per trajectory (TRL) refuses them with the reason.

- ``to_verl``: ``{"batch", "non_tensor_batch", "meta_info"}`` for ``DataProto.from_dict`` as
  verl's agent loop builds it: ``prompts`` left-padded to ``prompt_length``, ``responses``
  right-padded to ``response_length`` (fixed widths, so chunks concatenate), ``response_mask``,
  ``input_ids``, ``attention_mask``, ``position_ids``, float32 ``rollout_log_probs``, the reward on
  each sample's last response token in ``rm_scores``; numpy ``non_tensor_batch`` with
  ``__num_turns__``.
- ``to_trl``: the dict a TRL ``GRPOTrainer`` ``rollout_func`` returns: ``prompt_ids``,
  ``completion_ids``, ``logprobs``, ``env_mask`` (1 = model token, 0 = environment) and extra
  fields (``reward``, ``finish_reason``) that TRL forwards to reward functions.
- ``to_slime``: slime ``Sample.to_dict()`` documents (``Sample.from_dict`` loads them).
- ``to_openrlhf``: what OpenRLHF's agent executor returns per sample: ``observation_tokens``
  (prompt + response), ``action_ranges`` (each generation's ``[start, end)`` in it),
  ``rollout_log_probs`` over the whole sequence (0.0 outside actions), ``reward``, ``scores``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollout_service.errors import TrainerFormatError
from rollout_service.schemas import FinishReason, Segment, Trajectory

SLIME_STATUS_TRUNCATED = "truncated"
SLIME_STATUS_COMPLETED = "completed"
SLIME_STATUS_ABORTED = "aborted"
SLIME_STATUS_FAILED = "failed"


def segments_of(trajectory: Trajectory) -> list[Segment]:
    """The trajectory's segments in order: the top-level one, then ``trajectory.segments``."""
    first = Segment(
        prompt_ids=trajectory.prompt_ids,
        response_ids=trajectory.response_ids,
        loss_mask=trajectory.loss_mask,
        logprobs=trajectory.logprobs,
        turns=trajectory.turns,
        messages=trajectory.messages,
    )
    return [first, *trajectory.segments]


def _reward(trajectory: Trajectory, reward: float | None) -> float:
    return float(reward if reward is not None else trajectory.reward or 0.0)


def _rewards(trajectories: Sequence[Trajectory], rewards: Sequence[float | None] | None) -> list[float]:
    if rewards is not None and len(rewards) != len(trajectories):
        raise TrainerFormatError(
            f"got {len(rewards)} rewards for {len(trajectories)} trajectories; give one per trajectory"
        )
    return [_reward(t, rewards[i] if rewards is not None else None) for i, t in enumerate(trajectories)]


def _finish_reason(trajectory: Trajectory) -> str | None:
    return trajectory.finish_reason.value if trajectory.finish_reason else None


def _prompt_messages(segment: Segment) -> list[dict[str, Any]]:
    """The chat messages the segment's prompt was rendered from (those before its first answer)."""
    prompt = []
    for message in segment.messages:
        if message.get("role") == "assistant":
            break
        prompt.append(message)
    return prompt


def _num_generations(segment: Segment) -> int:
    return sum(1 for turn in segment.turns if turn.kind == "generation")


def to_verl(
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    prompt_length: int,
    response_length: int,
    rewards: Sequence[float | None] | None = None,
    uids: Sequence[str] | None = None,
) -> dict[str, Any]:
    """verl's batch, one row per segment; ``prompt_length``/``response_length`` are verl's
    ``rollout.prompt_length``/``rollout.response_length``. A segment longer than either is refused
    (verl would cut it). ``uids``: one GRPO group id per trajectory (verl's ``uid``)."""
    import numpy as np
    import torch

    if not trajectories:
        raise TrainerFormatError("to_verl needs at least one trajectory")
    if uids is not None and len(uids) != len(trajectories):
        raise TrainerFormatError(f"got {len(uids)} uids for {len(trajectories)} trajectories; give one per trajectory")
    scores = _rewards(trajectories, rewards)
    rows = [(i, j, segment) for i, t in enumerate(trajectories) for j, segment in enumerate(segments_of(t))]
    for i, j, segment in rows:
        if len(segment.prompt_ids) > prompt_length or len(segment.response_ids) > response_length:
            raise TrainerFormatError(
                f"trajectory {i} segment {j} has a {len(segment.prompt_ids)}-token prompt and a "
                f"{len(segment.response_ids)}-token response; prompt_length={prompt_length}, "
                f"response_length={response_length}: raise them (verl's rollout.prompt_length/response_length) "
                "or cap the episode (sampling.max_model_len)"
            )
    size = len(rows)
    prompts = torch.full((size, prompt_length), pad_token_id, dtype=torch.long)
    responses = torch.full((size, response_length), pad_token_id, dtype=torch.long)
    prompt_attention = torch.zeros((size, prompt_length), dtype=torch.long)
    response_attention = torch.zeros((size, response_length), dtype=torch.long)
    response_mask = torch.zeros((size, response_length), dtype=torch.long)
    log_probs = torch.zeros((size, response_length), dtype=torch.float32)
    rm_scores = torch.zeros((size, response_length), dtype=torch.float32)
    for row, (i, _, segment) in enumerate(rows):
        n_prompt, n_response = len(segment.prompt_ids), len(segment.response_ids)
        if n_prompt:
            prompts[row, prompt_length - n_prompt :] = torch.tensor(segment.prompt_ids)
            prompt_attention[row, prompt_length - n_prompt :] = 1
        if n_response:
            responses[row, :n_response] = torch.tensor(segment.response_ids)
            response_attention[row, :n_response] = 1
            response_mask[row, :n_response] = torch.tensor(segment.loss_mask)
            log_probs[row, :n_response] = torch.tensor(segment.logprobs, dtype=torch.float32)
            rm_scores[row, n_response - 1] = scores[i]
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    last = [j == len(segments_of(trajectories[i])) - 1 for i, j, _ in rows]
    non_tensor_batch = {
        "__num_turns__": np.array([len(segment.turns) for _, _, segment in rows], dtype=np.int32),
        "trajectory_index": np.array([i for i, _, _ in rows], dtype=np.int64),
        "segment_index": np.array([j for _, j, _ in rows], dtype=np.int64),
        "reward": np.array([scores[i] for i, _, _ in rows], dtype=np.float32),
        "finish_reason": np.array([_finish_reason(trajectories[i]) for i, _, _ in rows], dtype=object),
        "truncated": np.array(
            [trajectories[i].truncated and is_last for (i, _, _), is_last in zip(rows, last)], dtype=bool
        ),
    }
    if uids is not None:
        non_tensor_batch["uid"] = np.array([uids[i] for i, _, _ in rows], dtype=object)
    return {
        "batch": {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "rollout_log_probs": log_probs,
            "rm_scores": rm_scores,
        },
        "non_tensor_batch": non_tensor_batch,
        "meta_info": {},
    }


def to_trl(trajectories: Sequence[Trajectory], rewards: Sequence[float | None] | None = None) -> dict[str, list[Any]]:
    """What a TRL ``rollout_func(prompts, trainer)`` returns for these trajectories, one row per
    trajectory (TRL scores and groups one completion per prompt, so a multi-segment trajectory is
    refused)."""
    for i, t in enumerate(trajectories):
        if t.segments:
            raise TrainerFormatError(
                f"trajectory {i} has {1 + len(t.segments)} segments (its harness rewrote the conversation); "
                "TRL's rollout_func returns exactly one completion per prompt, so the later segments would be "
                "lost: train it with to_verl, to_slime or to_openrlhf (a sample per segment), or use an agent "
                "that only appends to its history"
            )
    return {
        "prompt_ids": [list(t.prompt_ids) for t in trajectories],
        "completion_ids": [list(t.response_ids) for t in trajectories],
        "logprobs": [list(t.logprobs) for t in trajectories],
        "env_mask": [list(t.loss_mask) for t in trajectories],
        "reward": _rewards(trajectories, rewards),
        "finish_reason": [_finish_reason(t) for t in trajectories],
    }


def slime_status(trajectory: Trajectory) -> str:
    if trajectory.finish_reason == FinishReason.error:
        return SLIME_STATUS_FAILED
    if trajectory.finish_reason == FinishReason.cancelled:
        return SLIME_STATUS_ABORTED
    return SLIME_STATUS_TRUNCATED if trajectory.truncated else SLIME_STATUS_COMPLETED


def to_slime(
    trajectories: Sequence[Trajectory],
    rewards: Sequence[float | None] | None = None,
    labels: Sequence[str | None] | None = None,
) -> list[dict[str, Any]]:
    """slime ``Sample.to_dict()`` documents, one per segment: ``tokens`` (prompt + response),
    ``response_length``, ``loss_mask`` and ``rollout_log_probs`` over the response,
    ``weight_versions`` (each generation's policy version); earlier segments are ``completed``,
    the last carries the episode's status."""
    scores = _rewards(trajectories, rewards)
    samples: list[dict[str, Any]] = []
    for i, t in enumerate(trajectories):
        parts = segments_of(t)
        for j, segment in enumerate(parts):
            samples.append(
                {
                    "index": len(samples),
                    "prompt": _prompt_messages(segment),
                    "tokens": list(segment.prompt_ids) + list(segment.response_ids),
                    "response_length": len(segment.response_ids),
                    "label": labels[i] if labels is not None else None,
                    "reward": scores[i],
                    "loss_mask": list(segment.loss_mask),
                    "rollout_log_probs": list(segment.logprobs),
                    "weight_versions": [
                        str(turn.policy_version)
                        for turn in segment.turns
                        if turn.kind == "generation" and turn.policy_version is not None
                    ],
                    "status": slime_status(t) if j == len(parts) - 1 else SLIME_STATUS_COMPLETED,
                    "metadata": {
                        "finish_reason": _finish_reason(t),
                        "num_turns": len(segment.turns),
                        "trajectory_index": i,
                        "segment_index": j,
                        "segments": len(parts),
                    },
                }
            )
    return samples


def to_openrlhf(
    trajectories: Sequence[Trajectory],
    rewards: Sequence[float | None] | None = None,
    prompts: Sequence[str] | None = None,
    labels: Sequence[str | None] | None = None,
) -> list[dict[str, Any]]:
    """OpenRLHF agent-executor outputs, one per segment, for its ``_process_response_into_experience``.
    ``truncated`` is set on the last segment of an episode a limit cut."""
    scores = _rewards(trajectories, rewards)
    samples = []
    for i, t in enumerate(trajectories):
        parts = segments_of(t)
        for j, segment in enumerate(parts):
            offset = len(segment.prompt_ids)
            samples.append(
                {
                    "prompt": prompts[i] if prompts is not None else "",
                    "label": labels[i] if labels is not None else None,
                    "images": None,
                    "mm_train_inputs": None,
                    "reward": scores[i],
                    "scores": scores[i],
                    "observation_tokens": list(segment.prompt_ids) + list(segment.response_ids),
                    "action_ranges": [
                        (offset + turn.start, offset + turn.end) for turn in segment.turns if turn.kind == "generation"
                    ],
                    "rollout_log_probs": [0.0] * offset + list(segment.logprobs),
                    "truncated": t.truncated and j == len(parts) - 1,
                    "extra_logs": {"num_generations": _num_generations(segment)},
                    "trajectory_index": i,
                    "segment_index": j,
                }
            )
    return samples


ADAPTERS: dict[str, Callable[..., Any]] = {
    "verl": to_verl,
    "trl": to_trl,
    "slime": to_slime,
    "openrlhf": to_openrlhf,
}


def adapter(name: str) -> Callable[..., Any]:
    """The adapter called ``name``; an unknown name lists the valid ones."""
    try:
        return ADAPTERS[name]
    except KeyError:
        raise TrainerFormatError(f"unknown trainer format {name!r}; use one of {', '.join(ADAPTERS)}") from None
