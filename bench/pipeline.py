"""What the service itself costs around the LLM: per-stage times and per-turn overhead.

Starts a local service (redis, gateway, a worker per queue) and a scripted LLM server that
answers instantly, then runs N jobs of T turns, in two shapes:
  - llm-only: no sandbox, every turn an LLM call plus a tool-call parse (tool: finish only),
  - bash: a bwrap sandbox per job, every turn an LLM call plus a bash command in it.
Reports jobs/s, turns/s, p50 of each stage's time, and the per-turn time of the run stage
that is neither the LLM call, the tool nor the sandbox boot (Redis bookkeeping, token deltas,
parsing, and waiting for a core: everything shares 2 cores here).

    .venv/bin/python bench/pipeline.py [--jobs 32] [--turns 8] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_service.local_service import local_service  # noqa: E402
from rollout_service.redis_server import free_port  # noqa: E402
from rollout_service.reference_server import ReferenceServerProcess  # noqa: E402
from rollout_service.tiny_model import build_tiny_tokenizer  # noqa: E402


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SHAPES = {
    "llm-only": {"tool": ("nothing", {}), "task": {"domain": "math", "answer": "4"},
                 "agent": {"tools": ["finish"]}, "finish": "\\boxed{4}"},
    "bash": {"tool": ("bash", {"command": "echo hi"}),
             "task": {"domain": "code", "test_list": ["assert f() == 1"]},
             "agent": {"tools": ["bash", "finish"]}, "finish": "def f():\n    return 1\n"},
}


def script(turns: int) -> dict[str, Any]:
    episodes = []
    for shape, spec in SHAPES.items():
        name, args = spec["tool"]
        steps = [call(name, **args)] * (turns - 1) + [call("finish", answer=spec["finish"])]
        episodes.append({"match": f"pipeline-bench-{shape}", "turns": steps})
    return {"episodes": episodes}


def task_for(shape: str, number: int) -> dict[str, Any]:
    text = f"pipeline-bench-{shape} #{number}: what is 2+2?"
    field = "problem" if SHAPES[shape]["task"]["domain"] == "math" else "text"
    return {**SHAPES[shape]["task"], field: text}


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 4) if values else float("nan")


def run_shape(client: Any, shape: str, jobs: int, turns: int) -> dict[str, Any]:
    started = time.monotonic()
    job_ids = []
    for number in range(jobs):
        job_ids += client.submit(task_for(shape, number), agent={**SHAPES[shape]["agent"], "max_turns": turns + 1}
                                 ).job_ids
    views = client.wait(job_ids, timeout_s=600, poll_s=0.05)
    wall_s = time.monotonic() - started
    assert all(v.status.value == "completed" and v.reward == 1.0 for v in views), [v.error for v in views]
    overheads, llm_s, tool_s, boot_s = [], [], [], []
    for view in views:
        trajectory = client.trajectory(view.job_id)
        generation = sum(t.latency_s for t in trajectory.turns if t.kind == "generation")
        observation = sum(t.latency_s for t in trajectory.turns if t.kind == "observation")
        calls = sum(t.kind == "generation" for t in trajectory.turns)
        llm_s.append(generation / calls)
        tool_s.append(observation / max(calls - 1, 1))
        boot_s.append(view.timings.sandbox_boot_s or 0.0)
        overheads.append((view.timings.run_s - generation - observation - boot_s[-1]) / calls)
    return {
        "jobs": jobs, "turns_per_job": turns, "wall_s": round(wall_s, 3),
        "jobs_per_s": round(jobs / wall_s, 2), "turns_per_s": round(jobs * turns / wall_s, 1),
        "p50_queued_s": p50([v.timings.queued_s for v in views]),
        "p50_init_s": p50([v.timings.init_s for v in views]),
        "p50_run_s": p50([v.timings.run_s for v in views]),
        "p50_eval_s": p50([v.timings.eval_s for v in views]),
        "p50_sandbox_boot_ms": round(p50(boot_s) * 1000, 1),
        "p50_llm_call_ms": round(p50(llm_s) * 1000, 2),
        "p50_tool_ms": round(p50(tool_s) * 1000, 2),
        "p50_run_overhead_per_turn_ms": round(p50(overheads) * 1000, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        state = Path(tmp)
        tokenizer = build_tiny_tokenizer(state / "tokenizer")
        (state / "script.json").write_text(json.dumps(script(args.turns)))
        server = ReferenceServerProcess(["--script", str(state / "script.json"), "--tokenizer", str(tokenizer)],
                                        port=free_port(), log_path=state / "scripted.log").start()
        try:
            with local_service(state / "service", appendonly=False, ROLLOUT_RUN_CONCURRENCY="16",
                               ROLLOUT_INIT_CONCURRENCY="4", ROLLOUT_EVAL_CONCURRENCY="2") as service, \
                    service.client() as client:
                client.add_backend(server.url, "vllm", "bench", tokenizer=str(tokenizer))
                run_shape(client, "llm-only", 4, args.turns)  # warm the workers' tokenizer caches
                results = {shape: run_shape(client, shape, args.jobs, args.turns) for shape in SHAPES}
        finally:
            server.stop()
    print(f"{'shape':10} {'jobs/s':>7} {'turns/s':>8} {'init p50':>9} {'run p50':>8} {'eval p50':>9} "
          f"{'boot ms':>8} {'llm ms':>7} {'tool ms':>8} {'overhead ms/turn':>17}")
    for shape, r in results.items():
        print(f"{shape:10} {r['jobs_per_s']:7.2f} {r['turns_per_s']:8.1f} {r['p50_init_s']:9.3f} "
              f"{r['p50_run_s']:8.3f} {r['p50_eval_s']:9.3f} {r['p50_sandbox_boot_ms']:8.1f} {r['p50_llm_call_ms']:7.2f} {r['p50_tool_ms']:8.2f} "
              f"{r['p50_run_overhead_per_turn_ms']:17.2f}")
    if args.json:
        print(json.dumps({"bench": "pipeline", **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
