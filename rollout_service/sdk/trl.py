"""TRL's ``GRPOTrainer`` on rollouts from the service.

    rollouts = ServiceRollouts(client, tasks, agent={...}, sampling={...}, sync_dir="sync")
    trainer = GRPOTrainer(model=..., args=GRPOConfig(num_generations=G, temperature=1.0, ...),
                          train_dataset=rollouts.dataset(), reward_funcs=[service_reward],
                          rollout_func=rollouts, callbacks=[rollouts.weight_sync()])

``ServiceRollouts`` is the ``rollout_func``: TRL hands it each prompt already repeated
``num_generations`` times; it submits every distinct prompt once as a group of that many jobs,
waits, and returns the trajectories' token ids, the engine's logprobs and ``env_mask`` (0 on tool
output) as ``to_trl`` makes them, plus ``reward`` and ``finish_reason`` for the reward functions.
``weight_sync()`` is a ``TrainerCallback`` that, after each optimizer step, saves the model and
pushes it through the service (pause → ``update_weights`` → resume with the global step as policy
version), so the next rollouts come from the weights being trained. Both log to the trainer's
metrics: the jobs' stage timings (``rollout/*_s``), the rollouts' policy version, the sync's
seconds (``sync/*_s``) and, with ``check_logprobs=True``, the largest gap between the trainer's
log-probabilities of the returned tokens and the engine's (``rollout/logprob_gap_max``).
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rollout_service.errors import TrainerFormatError
from rollout_service.schemas import JobView, Trajectory
from rollout_service.sdk.adapters import to_trl
from rollout_service.sdk.client import RolloutClient

PROMPT_FIELDS = ("problem", "question", "prompt", "problem_statement")
STAGES = ("queued_s", "init_s", "run_s", "eval_s")


def task_prompt(task: Mapping[str, Any]) -> str:
    """The text TRL sees as a task's prompt: its problem/question/prompt field."""
    for name in PROMPT_FIELDS:
        if isinstance(task.get(name), str):
            return task[name]
    raise TrainerFormatError(
        f"task {dict(task)!r} has none of the fields {', '.join(PROMPT_FIELDS)}; "
        "pass prompt_of= to ServiceRollouts to name its prompt"
    )


def service_reward(completions: list[Any], reward: list[float], **_: Any) -> list[float]:
    """A TRL reward function returning the service's reward of each rollout."""
    return list(reward)


def _metrics(trainer: Any) -> dict[str, list[float]] | None:
    store = getattr(trainer, "_metrics", None)
    if store is None:
        return None
    return store["train" if trainer.model.training else "eval"]


class ServiceRollouts:
    """TRL's ``rollout_func`` over the service, for ``tasks`` (task documents as POST /v1/jobs takes)."""

    def __init__(
        self,
        client: RolloutClient,
        tasks: Sequence[Mapping[str, Any]],
        *,
        sampling: dict[str, Any] | None = None,
        agent: dict[str, Any] | None = None,
        timeouts: dict[str, Any] | None = None,
        model: str | None = None,
        sync_dir: str | Path = "weight-sync",
        keep_checkpoints: int = 2,
        timeout_s: float = 1800.0,
        check_logprobs: bool = False,
        prompt_of: Callable[[Mapping[str, Any]], str] = task_prompt,
    ) -> None:
        self.client = client
        self.tasks: dict[str, dict[str, Any]] = {}
        for task in tasks:
            prompt = prompt_of(task)
            if self.tasks.setdefault(prompt, dict(task)) != dict(task):
                raise TrainerFormatError(
                    f"two different tasks share the prompt {prompt!r}; TRL passes prompts only, "
                    "so each task needs its own (pass prompt_of= to tell them apart)"
                )
        self.model = model
        self.fields = {
            "sampling": {**(sampling or {}), **({"model": model} if model else {})},
            "agent": agent,
            "timeouts": timeouts,
        }
        self.sync_dir = Path(sync_dir)
        self.keep_checkpoints = keep_checkpoints
        self.timeout_s = timeout_s
        self.check_logprobs = check_logprobs
        self.trainer: Any = None
        self.last_views: list[JobView] = []
        self.last_trajectories: list[Trajectory] = []

    def dataset(self) -> Any:
        """A ``datasets.Dataset`` with one ``prompt`` per task, for ``train_dataset``."""
        from datasets import Dataset

        return Dataset.from_dict({"prompt": list(self.tasks)})

    def weight_sync(self) -> WeightSync:
        return WeightSync(self)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        self.trainer = trainer
        started = time.monotonic()
        counts: dict[str, int] = {}
        for prompt in prompts:
            if not isinstance(prompt, str) or prompt not in self.tasks:
                raise TrainerFormatError(
                    f"prompt {prompt!r} is not one of this ServiceRollouts' tasks; train on ServiceRollouts.dataset()"
                )
            counts[prompt] = counts.get(prompt, 0) + 1
        jobs = [
            {"task": self.tasks[p], "n": n, **{k: v for k, v in self.fields.items() if v}} for p, n in counts.items()
        ]
        submissions = self.client.submit_many(jobs)
        job_ids = {p: list(s.job_ids) for p, s in zip(counts, submissions)}
        views = self.client.wait([j for ids in job_ids.values() for j in ids], timeout_s=self.timeout_s)
        stored = self.client.trajectories(v.job_id for v in views)
        by_id = {v.job_id: v for v in views}
        ordered_views, trajectories = [], []
        for prompt in prompts:
            job_id = job_ids[prompt].pop(0)
            ordered_views.append(by_id[job_id])
            trajectories.append(stored.get(job_id) or Trajectory())
        trajectories = [self._trainable(t, trainer) for t in trajectories]
        output = to_trl(trajectories, rewards=[v.reward or 0.0 for v in ordered_views])
        self.last_views, self.last_trajectories = ordered_views, trajectories
        self._log(trainer, ordered_views, trajectories, time.monotonic() - started, output)
        return output

    @staticmethod
    def _trainable(trajectory: Trajectory, trainer: Any) -> Trajectory:
        """TRL needs a token per completion: a rollout that generated nothing (it failed before its
        first answer) gets one end-of-sequence token outside the loss."""
        if trajectory.response_ids:
            return trajectory
        eos = trainer.processing_class.eos_token_id if hasattr(trainer.processing_class, "eos_token_id") else 0
        return trajectory.model_copy(update={"response_ids": [eos], "logprobs": [0.0], "loss_mask": [0]})

    def _log(
        self,
        trainer: Any,
        views: list[JobView],
        trajectories: list[Trajectory],
        seconds: float,
        output: dict[str, list[Any]],
    ) -> None:
        metrics = _metrics(trainer)
        if metrics is None:
            return
        metrics["rollout/wall_s"].append(seconds)
        for stage in STAGES:
            values = [getattr(v.timings, stage) for v in views if getattr(v.timings, stage) is not None]
            if values:
                metrics[f"rollout/{stage}"].append(statistics.fmean(values))
        versions = [
            turn.policy_version
            for t in trajectories
            for turn in t.turns
            if turn.kind == "generation" and turn.policy_version is not None
        ]
        if versions:
            metrics["rollout/policy_version_min"].append(min(versions))
            metrics["rollout/policy_version_max"].append(max(versions))
        metrics["rollout/failed"].append(sum(v.status.value != "completed" for v in views))
        metrics["rollout/tool_calls"].append(
            statistics.fmean(sum(1 for turn in t.turns if turn.kind == "observation") for t in trajectories)
        )
        if self.check_logprobs:
            metrics["rollout/logprob_gap_max"].append(logprob_gap(trainer.model, output))


def logprob_gap(model: Any, output: Mapping[str, list[Any]]) -> float:
    """The largest |trainer log-prob - engine log-prob| over the model's tokens of a rollout_func
    output (≈ 0 while the engines serve the weights being trained)."""
    import torch

    largest = 0.0
    device = next(model.parameters()).device
    with torch.no_grad():
        for prompt, completion, logprobs, mask in zip(
            output["prompt_ids"], output["completion_ids"], output["logprobs"], output["env_mask"]
        ):
            ids = torch.tensor([list(prompt) + list(completion)], device=device)
            logits = model(input_ids=ids).logits.float()[0, len(prompt) - 1 : -1]
            mine = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()
            chosen = torch.tensor(mask, dtype=torch.bool)
            if chosen.any():
                gap = (mine - torch.tensor(logprobs, dtype=torch.float32))[chosen].abs().max()
                largest = max(largest, float(gap))
    return largest


class WeightSync(TrainerCallback):
    """After each optimizer step: save, pause the engines, load the saved weights into every engine
    of the model, resume with the service's version at the start of training plus ``global_step``
    as the policy version. A failed load resumes under the version the engines still serve."""

    def __init__(self, rollouts: ServiceRollouts) -> None:
        self.rollouts = rollouts
        self.saved: list[Path] = []
        self.base_version = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.base_version = max((backend.policy_version for backend in self.rollouts.client.backends()), default=0)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        if model is None or not state.is_world_process_zero:
            return control
        step = self.base_version + int(state.global_step)
        client = self.rollouts.client
        started = time.monotonic()
        directory = (self.rollouts.sync_dir / f"step-{step}").resolve()
        getattr(model, "module", model).save_pretrained(directory)
        saved = time.monotonic()
        serving = client.pause(wait_s=60)["policy_version"]
        paused = time.monotonic()
        try:
            client.update_weights(str(directory), model=self.rollouts.model, policy_version=step)
        except BaseException:
            client.resume(policy_version=serving)
            raise
        updated = time.monotonic()
        client.resume(policy_version=step)
        resumed = time.monotonic()
        self.saved.append(directory)
        while len(self.saved) > self.rollouts.keep_checkpoints:
            shutil.rmtree(self.saved.pop(0), ignore_errors=True)
        metrics = _metrics(self.rollouts.trainer) if self.rollouts.trainer is not None else None
        if metrics is not None:
            for name, seconds in (
                ("save_s", saved - started),
                ("pause_s", paused - saved),
                ("update_s", updated - paused),
                ("resume_s", resumed - updated),
            ):
                metrics[f"sync/{name}"].append(seconds)
            metrics["sync/policy_version"].append(step)
        return control
