"""Every setting of the service, once, read from ``ROLLOUT_*`` environment variables.

The unit of a setting is part of its name. ``Settings.from_env()`` is the only reader of
the environment; processes call ``get_settings()``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

CORES = len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Settings:
    # fmt: off
    redis_url: str = ""  # the Redis of job state (and of the queues, without broker_url); empty: an embedded redis-server under state_dir
    broker_url: str = ""  # Celery's queues on a Redis of their own; empty: the same Redis as redis_url
    redis_socket_timeout_s: float = 10.0  # a Redis command's answer (then retried); above any single command, blocking reads stay shorter
    redis_connect_timeout_s: float = 3.0  # connecting to Redis (retried like a command)
    redis_retries: int = 3  # per command, exponential backoff, on connection errors and timeouts (at least this many tries)
    redis_outage_wait_s: float = 120.0  # a worker's Redis command rides out a Redis restart or failover this long (backoff up to 1 s) before its stage leaves the job to recovery
    state_dir: str = "./.rollout"  # the embedded Redis, logs, models, workspaces, harness environments
    bind_host: str = "127.0.0.1"  # gateway and Flower; 0.0.0.0 serves every interface (set ROLLOUT_API_TOKEN then)
    port: int = 8006  # the gateway's port
    flower_port: int = 5555  # Flower's port
    reference_port: int = 8100  # the port of the backend `up` starts (the reference server or vLLM)
    engine: str = "reference"  # what `up` serves the reference model with: "reference" (the project's server) or "vllm"
    vllm_venv: str = ".venv-vllm"  # the virtualenv of vLLM's CPU build (`make vllm`)
    vllm_kv_cache_gib: float = 2.0  # VLLM_CPU_KVCACHE_SPACE of an engine `up` starts
    reference_model: str = ""  # "" or "tiny": the tiny model built under state_dir; "smollm2"; or a path
    reference_max_batch_size: int = 32  # reference server: requests generated together as one batch
    reference_batch_window_ms: float = 5.0  # reference server: how long it gathers requests after the first before generating
    reference_torch_threads: int = 1  # reference server: torch threads (more are slower on a busy small machine)
    api_token: str = ""  # bearer token required on /v1 routes (and by Flower); empty: no authentication
    gateway_workers: int = 2  # gunicorn worker processes of the gateway
    init_concurrency: int = 128  # greenlets per init worker: init mostly waits on Redis and the file system
    run_concurrency: int = 256  # episodes per run worker process (gevent greenlets)
    run_workers: int = min(CORES, 4)  # run worker processes `up` starts: the run stage is most of the CPU
    eval_concurrency: int = min(2 * CORES, 8)  # prefork children per eval worker: sandboxed graders mostly wait on the sandbox
    control_concurrency: int = 4  # threads of a control worker (batch decisions, housekeeping)
    score_in_run: bool = True  # a run worker scores what is cheap and certain (tasks.quick_score): no eval hop for it
    init_in_run: bool = True  # jobs of domains that prepare cheaply (math, stem, code) skip the init queue: run prepares them
    stage_batch_max_jobs: int = 32  # jobs per stage message: one Celery task carries many jobs under load
    handoff_window_ms: float = 5.0  # a stage gathers the jobs it hands to the next one for this long
    episode_start_gap_ms: float = 0.1  # between the episodes of one run message, so their calls do not march in step
    worker_log_level: str = "WARNING"  # log level of the Celery workers (INFO logs two lines per task)
    task_events: bool = True  # Celery task events, what Flower shows; off spares every task sending them, a large part of Celery's cost per task
    gc_max_interval_s: float = 60.0  # a green worker collects cyclic garbage when idle, or this often under load
    metrics_flush_s: float = 0.5  # a green worker writes the metrics of the episodes that ended in this time together
    redis_max_connections: int = 64  # per process; callers beyond it wait for a free one
    redis_pool_wait_s: float = 30.0  # how long a caller waits for a free connection of its process's Redis pool
    redis_batch_linger_ms: float = 2.0  # a busy run worker gathers its episodes' Redis commands this long before their shared round trip (0: never)
    redis_batch_linger_min_episodes: int = 32  # a run worker lingers only while it runs at least this many episodes (fewer: each round trip leaves at once)
    job_ttl_s: int = 7 * 24 * 3600  # how long a job's records (hash, request, trajectory) and a batch's stay in Redis
    job_deadline_s: float = 1800.0  # a job's deadline from its creation, unless timeouts.job_s; bounds every LLM and tool call
    visibility_timeout_s: int = 4 * 3600  # the broker redelivers an unacknowledged message after this (at least twice job_deadline_s)
    max_redeliveries: int = 3  # deliveries of one stage a job may have; the next one fails it with redelivery_limit
    lease_ttl_s: int = 60  # a stage's per-job lease, renewed while the stage runs; a lost stage is sent again after twice this
    llm_call_timeout_s: float = 300.0  # one LLM call, unless timeouts.llm_call_s
    llm_connect_retries: int = 2  # connection retries against the same backend before the call moves to another
    backend_probe_interval_s: float = 5.0  # backends are health-probed, and the control worker reaps expired sandboxes, this often
    backend_outage_wait_s: float = 180.0  # an LLM call whose model has no healthy backend waits this long for one to come back
    cancel_check_s: float = 5.0  # a run worker aborts its LLM calls of a job at its cancel message; it also reads their jobs' cancel flags this often (a message lost with its connection); 0: never
    call_gate_lease_s: float = 1.5  # a green run worker starts later calls without a round trip each while its gate lease holds; 0: never
    pause_ttl_s: float = 600.0  # a weight-sync pause lifts by itself after this unless renewed
    engine_control_timeout_s: float = 30.0  # an engine's answer to pause/resume (plus the pause's `wait`)
    weight_update_timeout_s: float = 600.0  # an engine's answer to loading new weights from disk
    max_request_mb: int = 16  # a request body beyond this is a 413
    max_rollouts_per_request: int = 16384  # rollouts one POST may ask for (bulk: the sum of n; batch: groups x group_size)
    max_turns: int = 20  # LLM calls per episode, unless agent.max_turns
    max_new_tokens: int = 1024  # tokens per LLM call, unless sampling.max_new_tokens
    sandbox: str = "bwrap"  # bwrap | singularity (or apptainer) | local (no isolation: only when asked for explicitly)
    sandbox_fork_server: bool = True  # bwrap as root: sandboxes forked from one server per worker, not a bwrap each
    sandbox_scratch_dir: str = ""  # sockets, logs, code graders' workspaces; "": /dev/shm if a writable tmpfs, else TMPDIR
    sandbox_memory_mb: int = 2048  # address-space limit (RLIMIT_AS) of every process in a sandbox
    sandbox_boot_niceness: int = 10  # sandboxes boot at this priority (episodes starting go first), then serve at 0
    sandbox_concurrent_stops: int = 4  # sandboxes a worker process tears down at once after their episodes; the rest wait their turn
    sandbox_stop_niceness: int = 19  # a stopped sandbox's processes die at this priority (the episodes still running go first)
    sandbox_max_procs: int = 256  # process limit (RLIMIT_NPROC) of a sandbox
    sandbox_cpu_time_s: int = 3600  # CPU-time limit (RLIMIT_CPU) of an agent's sandbox
    tool_timeout_s: float = 120.0  # one tool call, unless timeouts.tool_s; then it is interrupted, then killed
    tool_output_cap_bytes: int = 32 * 1024  # a tool's output beyond this is cut in the middle (head and tail kept)
    eval_timeout_s: float = 60.0  # one grading; POST /v1/score waits this plus 30 s
    repo_roots: str = ""  # directories (os.pathsep- or comma-separated) task.repo_path may name besides state_dir
    image_roots: str = ""  # directories (os.pathsep- or comma-separated) a local image (oci:, oci-archive:, docker-archive:, .sif) may be under besides state_dir/images
    image_cache_dir: str = ""  # where this node unpacks images, one root file system per manifest digest; "": state_dir/image-cache
    image_cache_max_gb: float = 200.0  # the unpacked images a node keeps; past it the least recently used ones not in use go
    image_starts_per_node: int = 4  # sandboxes of one image starting at once on a node (the others wait their turn)
    image_pull_timeout_s: float = 1800.0  # fetching and unpacking one image
    swe_eval_timeout_s: float = 1800.0  # one grading of a swe task in its image (the SWE-bench harness allows 1800 s); task.timeout_s may lower it
    swe_image_template: str = ""  # a swe task without image or repo_path gets this image, e.g. docker://swebench/sweb.eval.x86_64.{instance_id}:latest ({instance_id} with __ as _1776_)
    harness_roots: str = ""  # directories (os.pathsep- or comma-separated) agent.harness.env_dir may be under besides state_dir/harnesses
    shutdown_grace_s: float = 15.0  # `up` stopping: each rank of pieces (gateway, workers, backends, Redis) gets this long before it is killed
    # fmt: on

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f"ROLLOUT_{f.name.upper()}")
            if raw is None:
                continue
            kind = type(f.default) if f.default is not dataclasses.MISSING else str
            try:
                values[f.name] = _flag(raw) if kind is bool else kind(raw)
            except ValueError as exc:
                from rollout_service.errors import ConfigError

                raise ConfigError(
                    f"ROLLOUT_{f.name.upper()}={raw!r} is not a valid {kind.__name__}; "
                    f"unset it or give a {kind.__name__}"
                ) from exc
        return cls(**values)

    @functools.cached_property
    def state_path(self) -> Path:
        return Path(self.state_dir).resolve()

    @functools.cached_property
    def workspaces_path(self) -> Path:
        return self.state_path / "workspaces"

    @functools.cached_property
    def repo_root_paths(self) -> tuple[str, ...]:
        """Where a swe task's ``repo_path`` may be (resolved): the state directory and ``repo_roots``."""
        named = [p.strip() for part in self.repo_roots.split(os.pathsep) for p in part.split(",")]
        return tuple(dict.fromkeys(os.path.realpath(p) for p in [str(self.state_path), *named] if p))

    @functools.cached_property
    def harness_root_paths(self) -> tuple[str, ...]:
        """Where a harness's ``env_dir`` may be (resolved): state_dir/harnesses and ``harness_roots``."""
        named = [p.strip() for part in self.harness_roots.split(os.pathsep) for p in part.split(",")]
        return tuple(dict.fromkeys(os.path.realpath(p) for p in [str(self.state_path / "harnesses"), *named] if p))

    @functools.cached_property
    def image_root_paths(self) -> tuple[str, ...]:
        """Where a local image may be (resolved): state_dir/images and ``image_roots``."""
        named = [p.strip() for part in self.image_roots.split(os.pathsep) for p in part.split(",")]
        return tuple(dict.fromkeys(os.path.realpath(p) for p in [str(self.state_path / "images"), *named] if p))

    @functools.cached_property
    def image_cache_path(self) -> Path:
        return Path(self.image_cache_dir).resolve() if self.image_cache_dir else self.state_path / "image-cache"

    @functools.cached_property
    def scratch_path(self) -> str:
        """Where the small per-sandbox directories go: a memory file system, since on a disk one,
        making and removing one costs journaling at every sandbox."""
        if self.sandbox_scratch_dir:
            return self.sandbox_scratch_dir
        import tempfile

        return "/dev/shm" if _is_writable_tmpfs("/dev/shm") else tempfile.gettempdir()

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _is_writable_tmpfs(path: str) -> bool:
    try:
        with open("/proc/self/mounts") as mounts:
            is_tmpfs = any(line.split()[1:3] == [path, "tmpfs"] for line in mounts)
    except OSError:
        return False
    return is_tmpfs and os.access(path, os.W_OK | os.X_OK)


def _flag(raw: str) -> bool:
    if raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if raw.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings.from_env()


# --------------------------------------------------------------------------- docs/settings.md
_UNITS = (("_s", "seconds"), ("_ms", "milliseconds"), ("_mb", "MB"), ("_gib", "GiB"), ("_bytes", "bytes"))


def reference() -> list[dict[str, str]]:
    """Every setting as docs/settings.md lists it, read from this module's source: the field, its
    environment variable, type, default (an expression of the machine, such as ``min(CORES, 4)``,
    as written), unit (from the name) and meaning (the field's comment)."""
    import ast
    import io
    import tokenize

    source = Path(__file__).read_text()
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    settings_class = next(
        node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "Settings"
    )
    rows = []
    for node in settings_class.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None):
            continue
        name, written = node.target.id, ast.get_source_segment(source, node.value) or ""
        if any(isinstance(n, ast.Name) for n in ast.walk(node.value)):
            default = f"`{written}`"
        else:
            value = eval(compile(ast.Expression(node.value), "<setting>", "eval"), {"__builtins__": {}})
            shown = (
                ("true" if value else "false")
                if isinstance(value, bool)
                else (f"{value:g}" if isinstance(value, float) else str(value))
            )
            default = f"`{shown}`" if shown else "(empty)"
            if not isinstance(node.value, ast.Constant):
                default += f" ({written})"
        rows.append(
            {
                "name": name,
                "env": f"ROLLOUT_{name.upper()}",
                "type": ast.unparse(node.annotation),
                "default": default,
                "unit": next((u for suffix, u in _UNITS if name.endswith(suffix)), ""),
                "meaning": comments.get(node.end_lineno or node.lineno, ""),
            }
        )
    return rows


def markdown() -> str:
    """docs/settings.md (``python -m rollout_service.settings --markdown > docs/settings.md``)."""
    rows = reference()
    lines = [
        "# Settings",
        "",
        "<!-- Generated by `python -m rollout_service.settings --markdown > docs/settings.md` from",
        "     rollout_service/settings.py; tests/test_settings.py fails when this file is out of date. -->",
        "",
        f"All {len(rows)} settings of the service. Each is an environment variable `ROLLOUT_<NAME>`, read once",
        "per process by `Settings.from_env()`; the unit is part of the name. Booleans take `1`/`true`/`yes`/`on`",
        "or `0`/`false`/`no`/`off`; a value of the wrong type stops the process with a `config_error` naming",
        "the variable. `CORES` is the number of CPUs the process may run on. The Slurm scripts and",
        "docker-compose read a few more variables of their own: see [operations](operations.md).",
        "",
        "| variable | type | default | unit | meaning |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        meaning = row["meaning"].replace("|", "\\|")
        lines.append(f"| `{row['env']}` | {row['type']} | {row['default']} | {row['unit']} | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m rollout_service.settings --markdown")
    sys.stdout.write(markdown())
