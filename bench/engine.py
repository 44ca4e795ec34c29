"""Real engine: one multi-turn workload straight at vLLM and through the service.

Starts two vLLM CPU servers (``rollout_service.devtools.engines.VLLMServer``, SmolLM2-135M-Instruct, the
``make vllm`` venv, ``--block-size 32``) once and reuses them for every phase, and a whole service
on this machine (``rollout_service.devtools.local_service``). The workload: R rollouts of up to T turns,
each a math problem whose system prompt starts with the problem (so no two rollouts share a cached
prefix and every prefix-cache hit is a rollout reusing its own history), tools ``["finish"]``,
greedy sampling with a fixed number of new tokens per call (``ignore_eos``, ``min_tokens``), and a
logit bias that makes the 135M model open a ``<tool_call>`` every turn. Each turn appends the
generated ids and the observation the service's agent adds (the parser's error or an unknown-tool
error, as a ``tool`` message rendered with the tokenizer's chat template); an episode ends where
the agent's would (no tool call, a ``finish`` call, T turns).

Phases, each after ``POST /reset_prefix_cache`` on both engines, all rollouts at once, after a
warm-up of both drivers on both engines:
  direct    a minimal asyncio client (httpx.AsyncClient) sends the service's own request body
            (``VLLMClient.generate_body``) to ``/inference/v1/generate`` of engine A
  service   the same rollouts as jobs through the service, engine A its only backend
            (``--rounds 2`` runs direct, service, service, direct; the mean of each is reported)
  sticky    through the service with A and B registered: its pool keeps a rollout on one engine
  rr        the direct client alternating A and B per call (round-robin)

Reports generated tokens/s of direct and service and their ratio; per-turn service overhead
(the run stage's time outside its LLM calls per call, from the jobs' timings and trajectories, and
the wall-time difference to direct per turn); vLLM's prefix-cache hit rate from ``/metrics``
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, deltas over the phase,
summed over both engines) for all turns and for later turns (the first turns' prompts, which share
nothing, taken out of the queries), next to its ceiling: the share of later turns' prompt tokens
that were the previous call's prompt and completion (in whole blocks), the rest (the observation)
being new to any cache.

    .venv/bin/python bench/engine.py [--rollouts 64] [--turns 4] [--new-tokens 32] [--rounds 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from rollout_service.devtools.engines import VLLMServer  # noqa: E402
from rollout_service.devtools.local_service import local_service  # noqa: E402
from rollout_service.devtools.models import SMOLLM2_LT_TOKEN_ID, build_smollm2  # noqa: E402
from rollout_service.devtools.redis_server import free_port  # noqa: E402
from rollout_service.runtime import inference  # noqa: E402
from rollout_service.runtime.inference import VLLMClient  # noqa: E402
from rollout_service.runtime.tokens import ChatRenderer, renderer_for  # noqa: E402
from rollout_service.runtime.toolcalls import ToolCallParser, get_parser  # noqa: E402
from rollout_service.schemas import Sampling  # noqa: E402
from rollout_service.sdk.client import RolloutClient  # noqa: E402
from rollout_service.tools.schemas import tool_schemas  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
TOOLS = ("finish",)
PARSER = "hermes"
METRIC_LINE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries))(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")
TOOL_CALL_TOKENS = {
    "<": SMOLLM2_LT_TOKEN_ID,
    "response": 7639,
}  # SmolLM2's ids: "<tool_call>" opens with "<", "<tool_response>" ends in "response"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def reusable_tokens(calls: list[tuple[int, int]], block_size: int) -> tuple[int, int]:
    """Over a rollout's later calls ((prompt tokens, generated tokens) per call): the tokens a prefix
    cache can hold for them at best (the previous call's prompt and all but its last generated token,
    in whole blocks), and their prompt tokens."""
    reusable = sum((prompt + generated - 1) // block_size * block_size for prompt, generated in calls[:-1])
    return reusable, sum(prompt for prompt, _ in calls[1:])


@dataclass(frozen=True)
class Rollout:
    number: int
    problem: str
    answer: str
    system_prompt: str

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": self.problem}]

    def job(self, sampling: dict[str, Any], turns: int) -> dict[str, Any]:
        return {
            "task": {
                "domain": "math",
                "problem": self.problem,
                "answer": self.answer,
                "system_prompt": self.system_prompt,
            },
            "sampling": sampling,
            "agent": {"tools": list(TOOLS), "max_turns": turns, "tool_parser": PARSER},
            "timeouts": {"job_s": 3600, "llm_call_s": 1800},
        }


def make_rollouts(count: int, offset: int = 0, filler_lines: int = 0) -> list[Rollout]:
    """``filler_lines``: lines of notes (~30 tokens each) after the problem, for a longer history."""
    rollouts = []
    for i in range(offset, offset + count):
        a, b, c = 17 + 7 * i, 5 + 11 * i, 3 + i % 9
        problem = f"What is ({a} + {b}) * {c}?"
        notes = "".join(
            f"Note {k}: {a} times {k} is {a * k}, and {b} plus {k} is {b + k}.\n" for k in range(1, filler_lines + 1)
        )
        # the problem first: the rollouts' prompts differ from their first block on
        example = json.dumps({"name": "calculator", "arguments": {"expression": f"({a} + {b}) * {c}"}})
        rollouts.append(
            Rollout(
                i,
                problem,
                str((a + b) * c),
                f"Problem {i}: {problem}\n{notes}You are a careful mathematician. Always reply with a tool "
                f"call, like this:\n<tool_call>\n{example}\n</tool_call>",
            )
        )
    return rollouts


def sampling_fields(new_tokens: int, tool_bias: float) -> dict[str, Any]:
    """Greedy, a fixed number of new tokens per call where the service's sampling can say so, and a
    logit bias that makes the 135M model open a tool call every turn (it rarely does by itself, and
    an answer without one ends the episode): "<" favoured, "<tool_response>" (which it copies from
    the observations) ruled out."""
    fields: dict[str, Any] = {"model": MODEL, "temperature": 0.0, "max_new_tokens": new_tokens}
    if "ignore_eos" in Sampling.model_fields:
        fields["ignore_eos"] = True
    if "min_tokens" in Sampling.model_fields:
        fields["min_tokens"] = new_tokens
    if "logit_bias" in Sampling.model_fields and tool_bias:
        fields["logit_bias"] = {str(TOOL_CALL_TOKENS["<"]): tool_bias, str(TOOL_CALL_TOKENS["response"]): -100.0}
    return fields


# -- the engines' /metrics ------------------------------------------------------------------------


def prefix_counters(urls: list[str]) -> dict[str, float]:
    totals = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if match := METRIC_LINE.match(line):
                totals[match.group(1)] += float(match.group(2))
    return totals


def reset_prefix_caches(urls: list[str]) -> None:
    for url in urls:
        response = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
        response.raise_for_status()


@dataclass
class PhaseResult:
    name: str
    engines: int
    wall_s: float
    generated_tokens: int
    llm_calls: int
    turns_histogram: dict[int, int]
    first_prompt_tokens: int
    prefix: dict[str, float]
    reusable: tuple[int, int]
    failures: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else float("nan")

    def summary(self) -> dict[str, Any]:
        hits, queries = self.prefix["vllm:prefix_cache_hits"], self.prefix["vllm:prefix_cache_queries"]
        later_queries = queries - self.first_prompt_tokens
        return {
            "engines": self.engines,
            "wall_s": round(self.wall_s, 3),
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "llm_calls": self.llm_calls,
            "turns_per_rollout": {str(k): v for k, v in sorted(self.turns_histogram.items())},
            "failures": self.failures,
            "errors": self.errors,
            "prefix_cache": {
                "hits": hits,
                "queries": queries,
                "first_turn_queries": self.first_prompt_tokens,
                "hit_rate": round(hits / queries, 4) if queries else None,
                "later_turns_hit_rate": round(hits / later_queries, 4) if later_queries > 0 else None,
                # later turns' hits if every call found its rollout's previous call cached
                "later_turns_ceiling": round(self.reusable[0] / self.reusable[1], 4) if self.reusable[1] else None,
            },
            **self.extra,
        }


def measure_prefix(urls: list[str]) -> PrefixWindow:
    return PrefixWindow(urls, prefix_counters(urls))


@dataclass
class PrefixWindow:
    urls: list[str]
    before: dict[str, float]

    def delta(self) -> dict[str, float]:
        after = prefix_counters(self.urls)
        return {name: after[name] - self.before[name] for name in after}


# -- (a) the direct client ------------------------------------------------------------------------


class EngineRoute:
    """The route and request body the service's vLLM client sends (``/inference/v1/generate`` where
    the client speaks it, else ``/v1/completions``), and its parsing of the answer."""

    def __init__(self, url: str) -> None:
        self.client = VLLMClient(url, MODEL)
        self.token_route = hasattr(self.client, "generate_body") and hasattr(inference, "vllm_sampling")
        self.url = url + (inference.GENERATE_PATH if self.token_route else "/v1/completions")

    def body(self, prompt_ids: list[int], sampling: Sampling) -> dict[str, Any]:
        if self.token_route:
            return self.client.generate_body(prompt_ids, inference.vllm_sampling(sampling, sampling.max_new_tokens))
        return self.client.request_body(prompt_ids, sampling, sampling.max_new_tokens)

    def generated_ids(self, payload: Any) -> list[int]:
        parse = self.client.parse_generate if self.token_route else self.client.parse_response
        return parse(payload)[0]


@dataclass
class DirectEpisode:
    calls: list[tuple[int, int]] = field(default_factory=list)  # (prompt tokens, generated tokens)
    call_latencies_s: list[float] = field(default_factory=list)


class DirectDriver:
    """What the service's agent does with the same renderer, parser and request body, in asyncio."""

    def __init__(self, tokenizer: str, sampling: Sampling, turns: int, concurrency: int, block_size: int) -> None:
        self.renderer: ChatRenderer = renderer_for(tokenizer)
        self.parser: ToolCallParser = get_parser(PARSER)
        self.sampling = sampling
        self.turns = turns
        self.concurrency = concurrency
        self.block_size = block_size

    def initial_prompt(self, rollout: Rollout) -> list[int]:
        return self.renderer.initial_prompt(rollout.messages, tool_schemas(TOOLS))

    async def episode(
        self,
        http: httpx.AsyncClient,
        engines: list[EngineRoute],
        rollout: Rollout,
        first_engine: int,
        gate: asyncio.Semaphore,
    ) -> DirectEpisode:
        context = self.initial_prompt(rollout)
        stats = DirectEpisode()
        async with gate:
            for turn in range(self.turns):
                engine = engines[(first_engine + turn) % len(engines)]
                started = time.monotonic()
                response = await http.post(engine.url, json=engine.body(context, self.sampling))
                response.raise_for_status()
                generated = engine.generated_ids(response.json())
                stats.call_latencies_s.append(time.monotonic() - started)
                stats.calls.append((len(context), len(generated)))
                observations = self.observations(generated)
                if observations is None:
                    break
                context += generated + self.renderer.observation_delta(observations, generated)
        return stats

    def observations(self, generated: list[int]) -> list[dict[str, Any]] | None:
        """The tool messages the agent answers ``generated`` with; None where its episode ends."""
        parsed = self.parser.parse(self.renderer.decode_generation(generated))
        if not parsed.calls and not parsed.errors:
            return None
        observations: list[dict[str, Any]] = [{"role": "tool", "content": e} for e in parsed.errors]
        for call in parsed.calls:
            if call.name == "finish" and "finish" in TOOLS:
                return None
            # Agent._act with no executor (tools ["finish"] need no sandbox)
            observations.append(
                {
                    "role": "tool",
                    "name": call.name,
                    "content": f"Error: unknown tool {call.name!r}. Available tools: {', '.join(TOOLS)}.",
                }
            )
        return observations

    def run(self, name: str, urls: list[str], rollouts: list[Rollout], round_robin: bool) -> PhaseResult:
        engines = [EngineRoute(url) for url in urls]
        first_prompt_tokens = sum(len(self.initial_prompt(r)) for r in rollouts)

        async def drive() -> list[DirectEpisode | BaseException]:
            gate = asyncio.Semaphore(self.concurrency)
            limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency * 2)
            async with httpx.AsyncClient(timeout=httpx.Timeout(1800, connect=10), limits=limits) as http:
                return await asyncio.gather(
                    *[
                        self.episode(
                            http,
                            engines if round_robin else engines[:1],
                            r,
                            i % len(engines) if round_robin else 0,
                            gate,
                        )
                        for i, r in enumerate(rollouts)
                    ],
                    return_exceptions=True,
                )

        window = measure_prefix(urls)
        started = time.monotonic()
        episodes = asyncio.run(drive())
        wall_s = time.monotonic() - started
        prefix = window.delta()
        done = [e for e in episodes if isinstance(e, DirectEpisode)]
        errors: dict[str, int] = {}
        for e in episodes:
            if isinstance(e, BaseException):
                errors[repr(e)[:200]] = errors.get(repr(e)[:200], 0) + 1
        histogram: dict[int, int] = {}
        for e in done:
            histogram[len(e.calls)] = histogram.get(len(e.calls), 0) + 1
        latencies = [s for e in done for s in e.call_latencies_s]
        reusable = [reusable_tokens(e.calls, self.block_size) for e in done]
        return PhaseResult(
            name,
            len(urls),
            wall_s,
            sum(g for e in done for _, g in e.calls),
            sum(len(e.calls) for e in done),
            histogram,
            first_prompt_tokens,
            prefix,
            (sum(r for r, _ in reusable), sum(q for _, q in reusable)),
            len(episodes) - len(done),
            errors,
            {"llm_call_s": {"p50": round(pct(latencies, 0.5), 3), "p99": round(pct(latencies, 0.99), 3)}},
        )


# -- (b) through the service ----------------------------------------------------------------------


def run_service_phase(
    name: str,
    client: RolloutClient,
    urls: list[str],
    rollouts: list[Rollout],
    sampling: dict[str, Any],
    turns: int,
    first_prompt_tokens: int,
    block_size: int,
) -> PhaseResult:
    bodies = [r.job(sampling, turns) for r in rollouts]
    window = measure_prefix(urls)
    started = time.monotonic()
    job_ids = [j for s in client.submit_many(bodies) for j in s.job_ids]
    submitted_s = time.monotonic() - started
    views = client.wait(job_ids, timeout_s=3600)
    wall_s = time.monotonic() - started
    prefix = window.delta()
    trajectories = client.trajectories(job_ids)
    errors: dict[str, int] = {}
    histogram: dict[int, int] = {}
    generated = calls = reusable = later_queries = 0
    outside_calls_per_turn, call_latencies, before_run, backends_per_rollout = [], [], [], []
    for view in views:
        if view.error:
            errors[view.error.message[:200]] = errors.get(view.error.message[:200], 0) + 1
        trajectory = trajectories.get(view.job_id)
        if view.status.value != "completed" or trajectory is None:
            continue
        generations = [t for t in trajectory.turns if t.kind == "generation"]
        histogram[len(generations)] = histogram.get(len(generations), 0) + 1
        generated += sum(t.end - t.start for t in generations)
        calls += len(generations)
        call_latencies += [t.latency_s for t in generations]
        backends_per_rollout.append(len({t.backend_id for t in generations}))
        rollout_reusable, rollout_queries = reusable_tokens(
            [(len(trajectory.prompt_ids) + t.start, t.end - t.start) for t in generations], block_size
        )
        reusable, later_queries = reusable + rollout_reusable, later_queries + rollout_queries
        in_turns = sum(t.latency_s for t in trajectory.turns)
        if view.timings.run_s is not None and generations:
            outside_calls_per_turn.append((view.timings.run_s - in_turns) / len(generations))
        before_run.append(sum(view.timings.waits_s.get(s, 0.0) for s in ("init", "run")) + (view.timings.init_s or 0.0))
    completed = sum(histogram.values())
    return PhaseResult(
        name,
        len(urls),
        wall_s,
        generated,
        calls,
        histogram,
        first_prompt_tokens,
        prefix,
        (reusable, later_queries),
        len(rollouts) - completed,
        errors,
        {
            "submit_s": round(submitted_s, 3),
            "llm_call_s": {"p50": round(pct(call_latencies, 0.5), 3), "p99": round(pct(call_latencies, 0.99), 3)},
            # run-stage time of a job outside its LLM calls (and tools), per call
            "run_overhead_per_turn_ms": {
                "p50": round(pct(outside_calls_per_turn, 0.5) * 1000, 2),
                "p99": round(pct(outside_calls_per_turn, 0.99) * 1000, 2),
            },
            "before_run_s": {
                "p50": round(pct(before_run, 0.5), 3),
                "max": round(max(before_run, default=float("nan")), 3),
            },
            "engines_per_rollout": {str(k): backends_per_rollout.count(k) for k in sorted(set(backends_per_rollout))},
        },
    )


# -- the run --------------------------------------------------------------------------------------


def start_engines(
    venv: Path, model_dir: Path, state: Path, count: int, kv_cache_gib: float, block_size: int
) -> list[VLLMServer]:
    """``count`` engines started side by side (each takes 1-3 minutes); all or none."""
    servers = [
        VLLMServer(
            venv,
            model_dir,
            MODEL,
            free_port(),
            state / f"vllm-{i}.log",
            kv_cache_gib,
            ("--block-size", str(block_size)),
        )
        for i in range(count)
    ]
    failures: list[BaseException] = []

    def start(server: VLLMServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=start, args=(s,), daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        if failures or any(t.is_alive() for t in threads):
            for server in servers:
                server.stop()
    if failures:
        raise failures[0]
    return servers


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = build_smollm2(Path(args.model_dir).expanduser())
    venv = Path(args.vllm_venv)
    venv = venv if venv.is_absolute() else ROOT / venv
    sampling = sampling_fields(args.new_tokens, args.tool_bias)
    rollouts = make_rollouts(args.rollouts, filler_lines=args.filler_lines)
    fixed_length = "ignore_eos" in sampling and "min_tokens" in sampling
    phases: dict[str, list[PhaseResult]] = {"direct": [], "service": []}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        state = Path(args.state_dir or tmp)
        state.mkdir(parents=True, exist_ok=True)
        print(f"starting 2 vLLM engines (logs in {state}) ...", flush=True)
        started = time.monotonic()
        engines = start_engines(venv, model_dir, state, 2, args.kv_cache_gib, args.block_size)
        startup_s = time.monotonic() - started
        urls = [e.url for e in engines]
        load_at_start = os.getloadavg()
        try:
            driver = DirectDriver(
                str(model_dir), Sampling(**sampling), args.turns, args.concurrency or args.rollouts, args.block_size
            )
            first_prompt_tokens = sum(len(driver.initial_prompt(r)) for r in rollouts)
            service_env = {
                "ROLLOUT_RUN_CONCURRENCY": str(args.concurrency or args.rollouts),
                "ROLLOUT_LLM_CALL_TIMEOUT_S": "1800",
            }
            (state / "service").mkdir(exist_ok=True)
            with (
                local_service(state / "service", appendonly=False, **service_env) as service,
                RolloutClient(service.url, timeout_s=600) as client,
            ):
                client.add_backend(urls[0], "vllm", MODEL, tokenizer=str(model_dir))
                warm = make_rollouts(min(4, args.rollouts), offset=10_000, filler_lines=args.filler_lines)
                driver.run("warm", urls, warm, round_robin=True)
                client.wait(
                    [j for s in client.submit_many([r.job(sampling, args.turns) for r in warm]) for j in s.job_ids],
                    timeout_s=1800,
                )
                order = ["direct", "service"]
                for round_number in range(args.rounds):
                    for name in order if round_number % 2 == 0 else order[::-1]:
                        reset_prefix_caches(urls)
                        if name == "direct":
                            result = driver.run(name, urls[:1], rollouts, round_robin=False)
                        else:
                            result = run_service_phase(
                                name,
                                client,
                                urls[:1],
                                rollouts,
                                sampling,
                                args.turns,
                                first_prompt_tokens,
                                args.block_size,
                            )
                        phases[name].append(result)
                        print_phase(result, round_number + 1)
                client.add_backend(urls[1], "vllm", MODEL, tokenizer=str(model_dir))
                reset_prefix_caches(urls)
                sticky = run_service_phase(
                    "sticky", client, urls, rollouts, sampling, args.turns, first_prompt_tokens, args.block_size
                )
                print_phase(sticky, 1)
                reset_prefix_caches(urls)
                round_robin = driver.run("rr", urls, rollouts, round_robin=True)
                print_phase(round_robin, 1)
        except Exception:
            dead = [e for e in engines if e.process is not None and e.process.poll() is not None]
            if dead:  # e.g. the kernel's OOM killer took its worker: say so rather than a refused connection
                raise SystemExit(
                    f"vLLM at {dead[0].url} died during the run (exit code {dead[0].process.returncode}); "
                    f"its log ({dead[0].log_path}) ends:\n" + dead[0].log_path.read_text(errors="replace")[-2000:]
                ) from None
            raise
        finally:
            for engine in engines:
                engine.stop()
    direct_tps = statistics.fmean(p.tokens_per_s for p in phases["direct"])
    service_tps = statistics.fmean(p.tokens_per_s for p in phases["service"])
    service_wall = statistics.fmean(p.wall_s for p in phases["service"])
    direct_wall = statistics.fmean(p.wall_s for p in phases["direct"])
    return {
        "rollouts": args.rollouts,
        "turns": args.turns,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "filler_lines": args.filler_lines,
        "block_size": args.block_size,
        "first_prompt_tokens_mean": round(first_prompt_tokens / max(1, args.rollouts), 1),
        "concurrency": args.concurrency or args.rollouts,
        "sampling": sampling,
        "fixed_length": fixed_length,
        "engine_startup_s": round(startup_s, 1),
        "load_average": {"start": [round(x, 2) for x in load_at_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "direct_tokens_per_s": round(direct_tps, 2),
        "service_tokens_per_s": round(service_tps, 2),
        "service_over_direct": round(service_tps / direct_tps, 4) if direct_tps else None,
        # the service's extra wall time spread over the calls of one rollout
        "wall_overhead_per_turn_ms": round(
            (service_wall - direct_wall)
            * 1000
            / max(1.0, statistics.fmean(p.llm_calls / max(1, args.rollouts) for p in phases["service"])),
            1,
        ),
        "sticky_later_turns_hit_rate": sticky.summary()["prefix_cache"]["later_turns_hit_rate"],
        "later_turns_ceiling": sticky.summary()["prefix_cache"]["later_turns_ceiling"],
        "round_robin_later_turns_hit_rate": round_robin.summary()["prefix_cache"]["later_turns_hit_rate"],
        "phases": {
            "direct": [p.summary() for p in phases["direct"]],
            "service": [p.summary() for p in phases["service"]],
            "sticky": sticky.summary(),
            "rr": round_robin.summary(),
        },
    }


def print_phase(result: PhaseResult, round_number: int) -> None:
    s = result.summary()
    cache = s["prefix_cache"]
    print(
        f"{result.name} (round {round_number}, {result.engines} engine(s)): {s['generated_tokens']} tokens in "
        f"{s['wall_s']} s = {s['tokens_per_s']} tokens/s; {s['llm_calls']} calls, turns per rollout "
        f"{s['turns_per_rollout']}; failures {s['failures']} {s['errors'] or ''}",
        flush=True,
    )
    print(
        f"  prefix cache: hit rate {cache['hit_rate']}, later turns {cache['later_turns_hit_rate']} "
        f"(at best {cache['later_turns_ceiling']}); "
        f"LLM call p50 {s['llm_call_s']['p50']} s",
        flush=True,
    )
    if "run_overhead_per_turn_ms" in s:
        print(
            f"  run stage outside LLM calls per turn p50 {s['run_overhead_per_turn_ms']['p50']} ms, "
            f"p99 {s['run_overhead_per_turn_ms']['p99']} ms; before run p50 {s['before_run_s']['p50']} s; "
            f"engines per rollout {s['engines_per_rollout']}",
            flush=True,
        )


def report(r: dict[str, Any]) -> None:
    print(
        f"{r['rollouts']} rollouts x up to {r['turns']} turns, {r['new_tokens']} new tokens per call "
        f"({'fixed' if r['fixed_length'] else 'at most'}), concurrency {r['concurrency']}, "
        f"load average (1, 5, 15 min) {r['load_average']}"
    )
    print(
        f"  direct {r['direct_tokens_per_s']} tokens/s, service {r['service_tokens_per_s']} tokens/s: "
        f"ratio {r['service_over_direct']}; wall overhead per turn {r['wall_overhead_per_turn_ms']} ms"
    )
    print(
        f"  prefix-cache hit rate of later turns: sticky (the service's pool, 2 engines) "
        f"{r['sticky_later_turns_hit_rate']}, round-robin {r['round_robin_later_turns_hit_rate']} "
        f"(at best {r['later_turns_ceiling']}: each call's prompt beyond its previous call is uncached)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32, help="max_new_tokens per LLM call")
    parser.add_argument("--concurrency", type=int, default=0, help="rollouts in flight; default: all of them")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="direct/service measurements, in the order direct, service, service, direct, ...",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="the engines' KV block size, the prefix cache's unit (vLLM's CPU default is 128)",
    )
    parser.add_argument(
        "--tool-bias", type=float, default=5.0, help='logit bias of "<" (0: none, and the model rarely calls a tool)'
    )
    parser.add_argument(
        "--filler-lines",
        type=int,
        default=0,
        help="lines of notes (~30 tokens each) in every system prompt: longer histories, so "
        "each turn's new tokens are a smaller part of its prompt",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="per engine (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--vllm-venv", default=os.environ.get("ROLLOUT_VLLM_VENV", ".venv-vllm"))
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache" / "rollout-service" / "smollm2"))
    parser.add_argument("--state-dir", default="", help="keep the engines' and the service's logs here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its engines
    r = run(args)
    report(r)
    if args.json:
        print(json.dumps({"bench": "engine", **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
