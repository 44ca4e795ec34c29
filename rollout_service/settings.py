"""Every setting of the service, once, read from ``ROLLOUT_*`` environment variables.

The unit of a setting is part of its name. ``Settings.from_env()`` is the only reader of
the environment; processes call ``get_settings()``.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, fields
from pathlib import Path

CORES = len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Settings:
    redis_url: str = ""  # empty: an embedded redis-server under state_dir
    broker_url: str = ""  # Celery's queues on a Redis of their own; empty: the same Redis as redis_url
    redis_socket_timeout_s: float = 10.0  # above any single command; blocking reads stay shorter
    redis_connect_timeout_s: float = 3.0
    redis_retries: int = 3  # per command, exponential backoff, on connection errors and timeouts
    state_dir: str = "./.rollout"
    bind_host: str = "127.0.0.1"  # gateway and Flower; 0.0.0.0 serves every interface (set ROLLOUT_API_TOKEN then)
    port: int = 8006
    flower_port: int = 5555
    reference_port: int = 8100
    engine: str = "reference"  # what `up` serves the reference model with: "reference" (the project's server) or "vllm"
    vllm_venv: str = ".venv-vllm"  # the virtualenv of vLLM's CPU build (`make vllm`)
    vllm_kv_cache_gib: float = 2.0  # VLLM_CPU_KVCACHE_SPACE of an engine `up` starts
    reference_model: str = ""  # "" or "tiny": the tiny model built under state_dir; "smollm2"; or a path
    reference_max_batch_size: int = 32
    reference_batch_window_ms: float = 5.0
    reference_torch_threads: int = 1  # 2 threads on a busy 2-core machine were 5-20x slower than 1
    api_token: str = ""
    gateway_workers: int = 2
    init_concurrency: int = 128  # greenlets: init mostly waits on Redis and the file system
    run_concurrency: int = 256  # episodes per run worker process (gevent greenlets)
    run_workers: int = min(CORES, 4)  # run worker processes `up` starts: the run stage is most of the CPU
    eval_concurrency: int = min(2 * CORES, 8)  # prefork children: sandboxed graders mostly wait on the sandbox
    control_concurrency: int = 4
    score_in_run: bool = True  # a run worker scores what is cheap and certain (tasks.quick_score): no eval hop for it
    init_in_run: bool = True  # jobs of domains that prepare cheaply (math, stem, code) skip the init queue: run prepares them
    stage_batch_max_jobs: int = 32  # jobs per stage message: one Celery task carries many jobs under load
    handoff_window_ms: float = 5.0  # a stage gathers the jobs it hands to the next one for this long
    episode_start_gap_ms: float = 0.1  # between the episodes of one run message, so their calls do not march in step
    worker_log_level: str = "WARNING"  # INFO logs two lines per task
    task_events: bool = True  # Celery task events, what Flower shows; off saves ~30% of Celery's cost per task
    gc_max_interval_s: float = 60.0  # a green worker collects cyclic garbage when idle, or this often under load
    metrics_flush_s: float = 0.5  # a green worker writes the metrics of the episodes that ended in this time together
    redis_max_connections: int = 64  # per process; callers beyond it wait for a free one
    redis_pool_wait_s: float = 30.0
    job_ttl_s: int = 7 * 24 * 3600
    job_deadline_s: float = 1800.0
    visibility_timeout_s: int = 4 * 3600
    max_redeliveries: int = 3
    lease_ttl_s: int = 60
    llm_call_timeout_s: float = 300.0
    llm_connect_retries: int = 2
    backend_probe_interval_s: float = 5.0
    backend_outage_wait_s: float = 180.0  # an LLM call whose model has no healthy backend waits this long for one to come back
    cancel_check_s: float = 5.0  # a run worker aborts its LLM calls of a job at its cancel message; it also reads their jobs' cancel flags this often (a message lost with its connection); 0: never
    call_gate_lease_s: float = 1.5  # a green run worker starts later calls without a round trip each while its gate lease holds; 0: never
    pause_ttl_s: float = 600.0  # a weight-sync pause lifts by itself after this unless renewed
    engine_control_timeout_s: float = 30.0  # an engine's answer to pause/resume (plus the pause's `wait`)
    weight_update_timeout_s: float = 600.0  # an engine's answer to loading new weights from disk
    max_request_mb: int = 16  # a request body beyond this is a 413
    max_rollouts_per_request: int = 16384  # rollouts one POST may ask for (bulk: the sum of n; batch: groups x group_size)
    max_turns: int = 20
    max_new_tokens: int = 1024
    sandbox: str = "bwrap"  # "local" (no isolation) only when asked for explicitly
    sandbox_fork_server: bool = True  # bwrap as root: sandboxes forked from one server per worker, not a bwrap each
    sandbox_scratch_dir: str = ""  # sockets, logs, code graders' workspaces; "": /dev/shm if a writable tmpfs, else TMPDIR
    sandbox_memory_mb: int = 2048
    sandbox_boot_niceness: int = 10  # sandboxes boot at this priority (episodes starting go first), then serve at 0
    sandbox_concurrent_stops: int = 4  # sandboxes a worker process tears down at once after their episodes; the rest wait their turn
    sandbox_stop_niceness: int = 19  # a stopped sandbox's processes die at this priority (the episodes still running go first)
    sandbox_max_procs: int = 256
    sandbox_cpu_time_s: int = 3600
    tool_timeout_s: float = 120.0
    tool_output_cap_bytes: int = 32 * 1024
    eval_timeout_s: float = 60.0
    repo_roots: str = ""  # directories (os.pathsep- or comma-separated) task.repo_path may name besides state_dir
    harness_roots: str = ""  # directories (os.pathsep- or comma-separated) agent.harness.env_dir may be under besides state_dir/harnesses
    shutdown_grace_s: float = 15.0  # `up` stopping: each rank of pieces (gateway, workers, backends, Redis) gets this long before it is killed

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        environ = os.environ if environ is None else environ
        values = {}
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
    def scratch_path(self) -> str:
        """Where the small per-sandbox directories go: on a disk file system, making and removing one
        cost ~1 ms of journaling per sandbox."""
        if self.sandbox_scratch_dir:
            return self.sandbox_scratch_dir
        import tempfile

        return "/dev/shm" if _is_writable_tmpfs("/dev/shm") else tempfile.gettempdir()

    def replace(self, **changes: object) -> "Settings":
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
