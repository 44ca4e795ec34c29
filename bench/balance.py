"""Load balance and prefix-cache reuse: BackendPool (sticky per rollout) vs round-robin per call.

N simulated vLLM servers (threaded HTTP on 127.0.0.1) serve ``POST /v1/completions`` with
token-id prompts. Each keeps a prefix cache: per rollout (keyed by the prompt's first tokens)
the last sequence it served (prompt + completion). It reports ``usage.prompt_tokens_details.
cached_tokens`` like vLLM and sleeps for uncached prefill tokens plus generated tokens.

Rollouts have heavy-tailed (Pareto) numbers of turns and run on a thread pool; each turn's
prompt is the previous prompt + the completion + an observation. A turn (after the first)
is a *cache hit* when the server's cache covers the whole previous prompt + completion,
i.e. the previous turn of that rollout ran on that same server.

Load definitions (sampled every ``--sample-ms``):
- live assignments (pool only): rollouts assigned to each backend, read from the Redis heap.
- in-flight requests (both policies): requests being served by each backend right now.
- imbalance at one sample = max over backends / mean over backends, on samples whose total
  load is > 0. "steady" = samples taken after every worker slot was filled and while rollouts
  were still waiting for a slot; "all" adds the ramp-up and the drain tail, where fewer
  rollouts are in flight than there are backends and no sticky policy can stay balanced.

    python bench/balance.py [--backends 4] [--rollouts 200] [--concurrency 32] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_service.devtools.redis_server import RedisServer  # noqa: E402
from rollout_service.schemas import BackendSpec  # noqa: E402
from rollout_service.state.backends import BackendPool  # noqa: E402

MODEL = "sim-model"
ROLLOUT_KEY_TOKENS = 8
VOCAB = 50_000


@dataclass(frozen=True)
class Latency:
    prefill_s_per_token: float = 40e-6
    decode_s_per_token: float = 1.0e-3
    tool_s: float = 0.010


class SimServer:
    """A vLLM-protocol completion server with a per-rollout prefix cache and simulated latency."""

    def __init__(self, latency: Latency) -> None:
        self.latency = latency
        self.cache: dict[tuple[int, ...], list[int]] = {}
        self.inflight = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> dict:
        prompt: list[int] = body["prompt"]
        key = tuple(prompt[:ROLLOUT_KEY_TOKENS])
        with self.lock:
            self.inflight += 1
            stored = self.cache.get(key, [])
        try:
            cached = len(stored) if prompt[: len(stored)] == stored else 0
            n_new = int(body.get("max_tokens", 16))
            time.sleep(
                (len(prompt) - cached) * self.latency.prefill_s_per_token + n_new * self.latency.decode_s_per_token
            )
            rng = random.Random(hash((key, len(prompt))))
            token_ids = [rng.randrange(VOCAB) for _ in range(n_new)]
            with self.lock:
                self.cache[key] = prompt + token_ids
        finally:
            with self.lock:
                self.inflight -= 1
        return {
            "object": "text_completion",
            "model": body.get("model", MODEL),
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "token_ids": token_ids,
                    "finish_reason": "length",
                    "logprobs": {"tokens": [f"token_id:{t}" for t in token_ids], "token_logprobs": [-1.0] * n_new},
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": n_new,
                "total_tokens": len(prompt) + n_new,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        sim = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes

            def do_GET(self) -> None:  # noqa: N802
                self._reply(200 if self.path == "/health" else 404, b"")

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self._reply(404, b"")
                self._reply(200, json.dumps(sim.complete(body)).encode())

            def _reply(self, code: int, payload: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        return Handler

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class RolloutPlan:
    rollout_id: str
    turns: int
    seed: int


def plan_rollouts(n: int, seed: int, max_turns: int) -> list[RolloutPlan]:
    rng = random.Random(seed)
    return [
        RolloutPlan(f"r{i}", min(max_turns, int(3 * rng.paretovariate(1.2))), rng.randrange(2**31)) for i in range(n)
    ]


@dataclass
class Stats:
    turns: int = 0
    hit_eligible: int = 0
    hits: int = 0
    same_backend_turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, eligible: bool, hit: bool, same_backend: bool, prompt_tokens: int, cached_tokens: int) -> None:
        with self.lock:
            self.turns += 1
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens
            self.hit_eligible += eligible
            self.hits += hit
            self.same_backend_turns += same_backend


class Policy:
    name = ""

    def start(self, rollout_id: str) -> None: ...

    def url_for_call(self, rollout_id: str) -> str: ...

    def finish(self, rollout_id: str) -> None: ...

    def live_assignments(self) -> list[int] | None:
        return None


class PoolPolicy(Policy):
    name = "pool"

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self.urls: dict[str, str] = {}

    def start(self, rollout_id: str) -> None:
        self.urls[rollout_id] = self.pool.acquire(rollout_id, None).url

    def url_for_call(self, rollout_id: str) -> str:
        return self.urls[rollout_id]

    def finish(self, rollout_id: str) -> None:
        self.pool.release(rollout_id)
        self.urls.pop(rollout_id, None)

    def live_assignments(self) -> list[int]:
        return [view.live_assignments for view in self.pool.list()]


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.counter = itertools.count()
        self.lock = threading.Lock()

    def url_for_call(self, rollout_id: str) -> str:
        with self.lock:
            return self.urls[next(self.counter) % len(self.urls)]


def run_rollout(
    plan: RolloutPlan, policy: Policy, pool: BackendPool, client: httpx.Client, stats: Stats, latency: Latency
) -> None:
    rng = random.Random(plan.seed)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(150, 400))]
    previous_context = 0
    first_url = ""
    policy.start(plan.rollout_id)
    try:
        for turn in range(plan.turns):
            while pool.begin_call(plan.rollout_id) is None:
                pool.wait_resumed(10.0, lambda: False)
            try:
                url = policy.url_for_call(plan.rollout_id)
                reply = (
                    client.post(
                        f"{url}/v1/completions",
                        json={
                            "model": MODEL,
                            "prompt": prompt,
                            "max_tokens": rng.randint(16, 64),
                            "temperature": 1.0,
                            "logprobs": 0,
                            "return_tokens_as_token_ids": True,
                        },
                    )
                    .raise_for_status()
                    .json()
                )
            finally:
                pool.end_call(plan.rollout_id)
            first_url = first_url or url
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            stats.record(
                eligible=turn > 0,
                hit=turn > 0 and cached >= previous_context,
                same_backend=url == first_url,
                prompt_tokens=len(prompt),
                cached_tokens=cached,
            )
            completion = reply["choices"][0]["token_ids"]
            previous_context = len(prompt) + len(completion)
            time.sleep(latency.tool_s)  # the tool call
            prompt = prompt + completion + [rng.randrange(VOCAB) for _ in range(rng.randint(20, 120))]
    finally:
        policy.finish(plan.rollout_id)


@dataclass
class Sample:
    steady: bool
    assignments: list[int] | None
    inflight: list[int]


def sample_loads(
    policy: Policy,
    servers: list[SimServer],
    waiting: Callable[[], bool],
    stop: threading.Event,
    period_s: float,
    out: list[Sample],
) -> None:
    while not stop.is_set():
        out.append(Sample(waiting(), policy.live_assignments(), [s.inflight for s in servers]))
        stop.wait(period_s)


def imbalance(loads: list[list[int]]) -> dict[str, float | int | None]:
    ratios = [max(load) / (sum(load) / len(load)) for load in loads if sum(load) > 0]
    if not ratios:
        return {"max": None, "mean": None, "samples": 0}
    return {"max": round(max(ratios), 3), "mean": round(sum(ratios) / len(ratios), 3), "samples": len(ratios)}


def run_policy(
    policy: Policy,
    plans: list[RolloutPlan],
    servers: list[SimServer],
    pool: BackendPool,
    concurrency: int,
    latency: Latency,
    sample_s: float,
) -> dict:
    for server in servers:
        server.cache.clear()
    stats = Stats()
    started = [0]
    started_lock = threading.Lock()
    samples: list[Sample] = []
    stop = threading.Event()

    def task(plan: RolloutPlan) -> None:
        with started_lock:
            started[0] += 1
        run_rollout(plan, policy, pool, client, stats, latency)

    def steady() -> bool:
        return concurrency <= started[0] < len(plans)

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    with httpx.Client(timeout=60.0, limits=limits) as client:
        sampler = threading.Thread(target=sample_loads, args=(policy, servers, steady, stop, sample_s, samples))
        t0 = time.monotonic()
        sampler.start()
        with ThreadPoolExecutor(concurrency) as executor:
            for future in [executor.submit(task, plan) for plan in plans]:
                future.result()
        wall_s = time.monotonic() - t0
        stop.set()
        sampler.join()

    steady = [s for s in samples if s.steady]
    result = {
        "wall_s": round(wall_s, 3),
        "turns": stats.turns,
        "cache_hit_rate": round(stats.hits / max(1, stats.hit_eligible), 4),
        "same_backend_turn_rate": round(stats.same_backend_turns / max(1, stats.turns), 4),
        "cached_prompt_token_rate": round(stats.cached_tokens / max(1, stats.prompt_tokens), 4),
        "inflight_requests_imbalance": {
            "steady": imbalance([s.inflight for s in steady]),
            "all": imbalance([s.inflight for s in samples]),
        },
    }
    if policy.live_assignments() is not None:
        result["live_assignments_imbalance"] = {
            "steady": imbalance([s.assignments for s in steady]),
            "all": imbalance([s.assignments for s in samples]),
        }
        result["live_assignments_after"] = policy.live_assignments()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=60)
    parser.add_argument("--sample-ms", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # ~100 threads share one GIL: keep hand-offs short

    latency = Latency()
    plans = plan_rollouts(args.rollouts, args.seed, args.max_turns)
    turns = sorted(plan.turns for plan in plans)
    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        redis_server = RedisServer(Path(tmp), appendonly=False).start()
        servers = [SimServer(latency) for _ in range(args.backends)]
        try:
            pool = BackendPool(redis.Redis.from_url(redis_server.url), prefix="bench")
            for server in servers:
                pool.register(BackendSpec(url=server.url, kind="vllm", model=MODEL))
            results = {
                "pool": run_policy(
                    PoolPolicy(pool), plans, servers, pool, args.concurrency, latency, args.sample_ms / 1000
                ),
                "round_robin": run_policy(
                    RoundRobinPolicy([s.url for s in servers]),
                    plans,
                    servers,
                    pool,
                    args.concurrency,
                    latency,
                    args.sample_ms / 1000,
                ),
            }
        finally:
            for server in servers:
                server.stop()
            redis_server.stop()

    pool_result, rr_result = results["pool"], results["round_robin"]
    checks = {
        "pool_live_assignments_steady_max_over_mean_le_1.25": (
            pool_result["live_assignments_imbalance"]["steady"]["max"] or 0
        )
        <= 1.25,
        "pool_cache_hit_ge_0.95": pool_result["cache_hit_rate"] >= 0.95,
        "pool_same_backend_turns_eq_1": pool_result["same_backend_turn_rate"] == 1.0,
        "round_robin_cache_hit_le_0.30": rr_result["cache_hit_rate"] <= 0.30,
        "pool_counts_back_to_zero": set(pool_result["live_assignments_after"]) == {0},
    }
    report = {
        "bench": "balance",
        "backends": args.backends,
        "rollouts": args.rollouts,
        "concurrency": args.concurrency,
        "turns_per_rollout": {
            "min": turns[0],
            "median": turns[len(turns) // 2],
            "p90": turns[int(len(turns) * 0.9)],
            "max": turns[-1],
            "total": sum(turns),
        },
        "definitions": {
            "imbalance": "max over backends / mean over backends of the load at one sample "
            "(samples with total load > 0); max and mean are over time",
            "steady": "samples after every worker slot has been filled and while rollouts are still waiting for a slot",
            "all": "every sample, including the ramp-up and the drain tail (fewer rollouts "
            "in flight than backends), where no sticky policy can stay balanced",
            "cache_hit_rate": "turns after the first whose prompt the server had cached through "
            "the previous turn's completion (previous turn on the same server)",
            "cached_prompt_token_rate": "prompt tokens served from cache / all prompt tokens; "
            "the simulated cache never evicts, so round-robin still "
            "reuses prefixes from a rollout's older visits",
            "same_backend_turn_rate": "turns served by the backend of the rollout's first turn",
        },
        **results,
        "checks": checks,
        "ok": all(checks.values()),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
