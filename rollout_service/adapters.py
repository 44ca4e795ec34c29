"""Trajectories in the shapes RL trainers consume: pure functions, nothing re-tokenized.

- ``to_verl``: a DataProto-like ``{"batch": tensors, "non_tensor_batch": lists}`` as verl's agent
  loop hands to the trainer: ``prompts`` left-padded, ``responses`` right-padded,
  ``response_mask`` (1 = policy token), ``input_ids``, ``attention_mask``, ``position_ids``,
  ``rollout_log_probs`` and ``token_level_scores`` (the reward on the last response token).
- ``to_trl``: the dict a TRL ``GRPOTrainer`` ``rollout_func`` returns: ``prompt_ids``,
  ``completion_ids``, ``logprobs``, ``env_mask`` (1 = model token, 0 = environment) and extra
  fields (``reward``, ``finish_reason``) that TRL forwards to reward functions.
- ``to_slime``: slime ``Sample`` fields: ``tokens`` (prompt + response), ``response_length``,
  ``reward``, ``loss_mask``, ``rollout_log_probs``, ``status``.
- ``to_openrlhf``: OpenRLHF-style samples: ``sequences``, ``attention_mask``, ``action_mask``,
  ``rollout_log_probs``, ``rewards``, ``response_length``, ``total_length``.

Logprobs are the inference server's, exactly; tensors of them are float64 so that no value
changes on the way (cast to your training dtype yourself).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from rollout_service.schemas import FinishReason, Trajectory

SLIME_STATUS_TRUNCATED = "truncated"
SLIME_STATUS_COMPLETED = "completed"
SLIME_STATUS_ABORTED = "aborted"
SLIME_STATUS_FAILED = "failed"


def _reward(trajectory: Trajectory, reward: Optional[float]) -> float:
    return float(reward if reward is not None else trajectory.reward or 0.0)


def _rewards(trajectories: Sequence[Trajectory], rewards: Optional[Sequence[Optional[float]]]) -> list[float]:
    if rewards is not None and len(rewards) != len(trajectories):
        raise ValueError(f"got {len(rewards)} rewards for {len(trajectories)} trajectories; give one per trajectory")
    return [_reward(t, rewards[i] if rewards is not None else None) for i, t in enumerate(trajectories)]


def to_verl(trajectories: Sequence[Trajectory], pad_token_id: int,
            rewards: Optional[Sequence[Optional[float]]] = None) -> dict[str, Any]:
    """verl's batch for ``trajectories`` (rewards default to each trajectory's own)."""
    import torch

    if not trajectories:
        raise ValueError("to_verl needs at least one trajectory")
    scores = _rewards(trajectories, rewards)
    batch_size = len(trajectories)
    prompt_width = max(len(t.prompt_ids) for t in trajectories)
    response_width = max(max(len(t.response_ids) for t in trajectories), 1)
    prompts = torch.full((batch_size, prompt_width), pad_token_id, dtype=torch.long)
    responses = torch.full((batch_size, response_width), pad_token_id, dtype=torch.long)
    prompt_attention = torch.zeros((batch_size, prompt_width), dtype=torch.long)
    response_attention = torch.zeros((batch_size, response_width), dtype=torch.long)
    response_mask = torch.zeros((batch_size, response_width), dtype=torch.long)
    log_probs = torch.zeros((batch_size, response_width), dtype=torch.float64)
    token_level_scores = torch.zeros((batch_size, response_width), dtype=torch.float64)
    for i, t in enumerate(trajectories):
        n_prompt, n_response = len(t.prompt_ids), len(t.response_ids)
        if n_prompt:
            prompts[i, prompt_width - n_prompt:] = torch.tensor(t.prompt_ids)
            prompt_attention[i, prompt_width - n_prompt:] = 1
        if n_response:
            responses[i, :n_response] = torch.tensor(t.response_ids)
            response_attention[i, :n_response] = 1
            response_mask[i, :n_response] = torch.tensor(t.loss_mask)
            log_probs[i, :n_response] = torch.tensor(t.logprobs, dtype=torch.float64)
            token_level_scores[i, n_response - 1] = scores[i]
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    return {
        "batch": {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "rollout_log_probs": log_probs,
            "token_level_scores": token_level_scores,
        },
        "non_tensor_batch": {
            "reward": scores,
            "finish_reason": [t.finish_reason.value if t.finish_reason else None for t in trajectories],
            "truncated": [t.truncated for t in trajectories],
            "num_turns": [len(t.turns) for t in trajectories],
        },
    }


def to_trl(trajectories: Sequence[Trajectory], rewards: Optional[Sequence[Optional[float]]] = None
           ) -> dict[str, list[Any]]:
    """What a TRL ``rollout_func(prompts, trainer)`` returns for these trajectories."""
    return {
        "prompt_ids": [list(t.prompt_ids) for t in trajectories],
        "completion_ids": [list(t.response_ids) for t in trajectories],
        "logprobs": [list(t.logprobs) for t in trajectories],
        "env_mask": [list(t.loss_mask) for t in trajectories],
        "reward": _rewards(trajectories, rewards),
        "finish_reason": [t.finish_reason.value if t.finish_reason else None for t in trajectories],
    }


def slime_status(trajectory: Trajectory) -> str:
    if trajectory.finish_reason == FinishReason.error:
        return SLIME_STATUS_FAILED
    if trajectory.finish_reason == FinishReason.cancelled:
        return SLIME_STATUS_ABORTED
    return SLIME_STATUS_TRUNCATED if trajectory.truncated else SLIME_STATUS_COMPLETED


def to_slime(trajectory: Trajectory, reward: Optional[float] = None) -> dict[str, Any]:
    """One slime ``Sample`` as a dict (``Sample(**to_slime(t))`` once mapped to its status enum)."""
    return {
        "tokens": list(trajectory.prompt_ids) + list(trajectory.response_ids),
        "response_length": len(trajectory.response_ids),
        "reward": _reward(trajectory, reward),
        "loss_mask": list(trajectory.loss_mask),
        "rollout_log_probs": list(trajectory.logprobs),
        "status": slime_status(trajectory),
        "metadata": {"finish_reason": trajectory.finish_reason.value if trajectory.finish_reason else None,
                     "num_turns": len(trajectory.turns)},
    }


def to_openrlhf(trajectory: Trajectory, reward: Optional[float] = None) -> dict[str, Any]:
    """One OpenRLHF-style sample: the whole sequence with an action mask over its response part."""
    n_prompt, n_response = len(trajectory.prompt_ids), len(trajectory.response_ids)
    return {
        "sequences": list(trajectory.prompt_ids) + list(trajectory.response_ids),
        "attention_mask": [1] * (n_prompt + n_response),
        "action_mask": list(trajectory.loss_mask),
        "rollout_log_probs": list(trajectory.logprobs),
        "rewards": _reward(trajectory, reward),
        "response_length": n_response,
        "total_length": n_prompt + n_response,
    }


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
        raise ValueError(f"unknown trainer format {name!r}; use one of {', '.join(ADAPTERS)}") from None
