"""``rollout-service``: run the whole service (``up``) or single pieces, submit tasks, reap."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis

from rollout_service.devtools.engines import ENGINES, VLLM_START_TIMEOUT_S
from rollout_service.devtools.models import reference_model_name, resolve_reference_model
from rollout_service.errors import ConfigError, RolloutError, StoreUnavailable
from rollout_service.launch.commands import (
    FLOWER_NICENESS,
    FLOWER_USER,
    POOL_KINDS,
    WATCH_INTERVAL_S,
    WORKER_POOLS,
    WorkerOptions,
    flower_command,
    gateway_command,
    local_address,
    wait_http,
    worker_command,
)
from rollout_service.launch.supervisor import INTAKE, SERVICES, STORE, Supervisor
from rollout_service.schemas import BackendView, JobView
from rollout_service.settings import Settings, get_settings

FAILED_STATUSES = ("failed", "timed_out", "cancelled")


def served_model(settings: Settings, engine: str) -> str:
    """What the backend `up` starts serves: ROLLOUT_REFERENCE_MODEL; by default the tiny model on
    the project's server, SmolLM2 on vLLM (a random-weight model is no use to a real engine)."""
    chosen = settings.reference_model.strip()
    return chosen or ("smollm2" if engine == "vllm" else "tiny")


def engine_command(settings: Settings, engine: str, model_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The command and extra environment of the backend `up` starts (ROLLOUT_ENGINE)."""
    if engine == "vllm":
        from rollout_service.devtools.engines import vllm_command, vllm_env

        name = reference_model_name(served_model(settings, engine))
        return (
            vllm_command(Path(settings.vllm_venv).resolve(), model_dir, name, settings.reference_port),
            vllm_env(settings.vllm_kv_cache_gib),
        )
    if engine == "reference":
        return reference_command(settings, model_dir), {}
    raise ConfigError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)} (ROLLOUT_ENGINE or --engine)")


def reference_command(settings: Settings, model_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollout_service.devtools.reference_server",
        "--model",
        str(model_dir),
        "--port",
        str(settings.reference_port),
        "--host",
        "127.0.0.1",
    ]


def register_reference(gateway: str, reference: str, model_dir: Path, settings: Settings, engine: str) -> None:
    headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
    answer = httpx.post(
        f"{gateway}/v1/backends",
        headers=headers,
        timeout=10,
        json={
            "url": reference,
            "kind": "vllm" if engine == "vllm" else "reference",
            "model": reference_model_name(served_model(settings, engine)),
            "tokenizer": str(model_dir),
        },
    )
    if answer.status_code == 503:  # Redis is restarting
        raise StoreUnavailable(answer.text[:500])
    if not answer.is_success:
        raise ConfigError(f"registering the reference backend failed: {answer.status_code} {answer.text[:500]}")


Step = TypeVar("Step")


def while_pieces_restart(supervisor: Supervisor, step: Callable[[], Step], what: str, timeout_s: float = 120) -> Step:
    """A start-up step that needs Redis or the gateway, tried again while the supervisor restarts
    a piece that died meanwhile (``Supervisor.check``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return step()
        except (redis.RedisError, httpx.HTTPError, StoreUnavailable) as exc:
            if time.monotonic() > deadline:
                raise ConfigError(f"{what} failed for {timeout_s:.0f} s: {exc}; see {supervisor.log_dir}") from exc
            supervisor.check()
            time.sleep(0.3)


def probe_backends_at_start(redis_url: str) -> list[BackendView]:
    """Probe every registered backend until one probe round decides its health (backends left in
    Redis by an earlier run are marked unhealthy instead of showing ``healthy: true``)."""
    from rollout_service.state.backends import FAILURES_TO_UNHEALTHY, BackendPool

    client = redis.Redis.from_url(redis_url)
    try:
        pool = BackendPool(client)
        for _ in range(FAILURES_TO_UNHEALTHY):
            pool.probe()
        return pool.list()
    finally:
        client.close()


def flower_env(settings: Settings) -> dict[str, str]:
    """With an API token, Flower asks for it too (user ``rollout``); given in its environment,
    not its arguments, which every local user can read."""
    return {"FLOWER_BASIC_AUTH": f"{FLOWER_USER}:{settings.api_token}"} if settings.api_token else {}


def mask_password(url: str) -> str:
    scheme, _, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    return f"{scheme}://{credentials.split(':')[0]}:***@{host}" if at and ":" in credentials else url


def start_pieces(supervisor: Supervisor, settings: Settings, args: argparse.Namespace, model_dir: Path | None) -> None:
    if model_dir is not None:
        command, env = engine_command(settings, args.engine, model_dir)
        supervisor.start(args.engine, command, stop_rank=SERVICES, env=env)
    supervisor.start("gateway", gateway_command(settings), stop_rank=INTAKE)
    for queue in WORKER_POOLS:
        copies = {"run": args.run_workers or settings.run_workers, "init": args.init_workers}.get(queue, 1)
        for index in range(copies):
            suffix = f"-{index + 1}" if copies > 1 else ""
            supervisor.start(f"worker-{queue}{suffix}", worker_command(settings, queue))
    # monitoring yields the CPU to rollouts: it reads every task event, a burst at a big submission
    supervisor.start(
        "flower", flower_command(settings), niceness=FLOWER_NICENESS, stop_rank=SERVICES, env=flower_env(settings)
    )


def cmd_up(args: argparse.Namespace) -> int:
    from rollout_service.devtools.redis_server import RedisServer, write_private

    settings = get_settings()
    args.engine = args.engine or settings.engine
    state = settings.state_path
    state.mkdir(parents=True, exist_ok=True)
    redis_server: RedisServer | None = None
    redis_url = settings.redis_url
    supervisor = Supervisor(state / "logs", {}, stop_grace_s=settings.shutdown_grace_s, report=sys.stdout)
    if not redis_url:
        redis_server = RedisServer(state / "redis", port=args.redis_port)
        redis_command = redis_server.command()
        redis_process = redis_server.launch(redis_command)
        redis_server.wait_ready()
        redis_url = redis_server.url
        supervisor.adopt(
            "redis",
            redis_process,
            redis_command,
            STORE,
            launch=redis_server.launch,
            ready=redis_server.wait_ready,
            log_path=redis_server.data_dir / "redis.log",
        )
    write_private(state / "redis.url", redis_url)
    supervisor.env = {**os.environ, "ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_STATE_DIR": str(state)}
    stop_now = lambda *_: (_ for _ in ()).throw(KeyboardInterrupt())  # noqa: E731
    for stop_signal in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell's `cmd &` starts it ignored
        signal.signal(stop_signal, stop_now)
    try:
        with_reference = not args.no_reference
        model_dir = None
        if with_reference:
            model = served_model(settings, args.engine)
            if args.engine not in ENGINES:
                raise ConfigError(
                    f"unknown engine {args.engine!r}; valid: {', '.join(ENGINES)} (ROLLOUT_ENGINE or --engine)"
                )
            print(
                f"preparing the model {reference_model_name(model)!r} for the {args.engine} engine (once) ...",
                flush=True,
            )
            model_dir = resolve_reference_model(model, state)
        start_pieces(supervisor, settings, args, model_dir)
        address = local_address(settings)
        gateway = f"http://{address}:{settings.port}"
        reference = f"http://127.0.0.1:{settings.reference_port}"
        wait_http(f"{gateway}/healthz", supervisor, 60)
        if model_dir is not None:
            if args.engine == "vllm":
                print(
                    f"starting vLLM (its log: {supervisor.log_dir / 'vllm.log'}; 1-3 minutes on a small machine) ...",
                    flush=True,
                )
            wait_http(f"{reference}/health", supervisor, VLLM_START_TIMEOUT_S if args.engine == "vllm" else 120)
            while_pieces_restart(
                supervisor,
                lambda: register_reference(gateway, reference, model_dir, settings, args.engine),
                "registering the reference backend",
            )
        backends = while_pieces_restart(supervisor, lambda: probe_backends_at_start(redis_url), "probing backends")
        if with_reference and not any(b.url == reference and b.healthy for b in backends):
            raise ConfigError(
                f"the {args.engine} backend {reference} is not registered as healthy; "
                f"see {supervisor.log_dir / (args.engine + '.log')}"
            )
        wait_http(f"{gateway}/readyz", supervisor, 120)
        wait_http(f"http://{address}:{settings.flower_port}/healthcheck", supervisor, 60)
        unhealthy = [b for b in backends if not b.healthy]
        everywhere = " (every interface)" if address != settings.bind_host else ""
        run_workers = args.run_workers or settings.run_workers
        print(
            f"rollout-service is up (Ctrl-C stops everything; a piece that dies is restarted)\n"
            f"  gateway    {gateway}{everywhere}   (try {gateway}/v1/backends, {gateway}/ui/)\n"
            f"  flower     http://{address}:{settings.flower_port}{everywhere}"
            + (f"  (user {FLOWER_USER!r}, the API token as password)" if settings.api_token else "")
            + "\n"
            + (
                f"  {args.engine:<10} {reference}  (model '{reference_model_name(served_model(settings, args.engine))}', registered and healthy)\n"
                if with_reference
                else ""
            )
            + f"  workers    init x{args.init_workers}, run x{run_workers}, eval, control\n"
            f"  redis      {mask_password(redis_url)}"
            + (f"  (password in {redis_server.data_dir / 'password'})" if redis_server else "")
            + "\n"
            f"  logs       {supervisor.log_dir}",
            flush=True,
        )
        for b in unhealthy:
            print(
                f"  unhealthy backend {b.id} {b.url} (model {b.model!r}) does not answer /health; "
                f"remove it with DELETE {gateway}/v1/backends/{b.id}",
                flush=True,
            )
        while True:
            supervisor.watch()
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        print("\nstopping: intake, then workers, then backends and monitoring, then Redis ...", flush=True)
        return 0
    finally:
        for stop_signal in (signal.SIGTERM, signal.SIGINT):  # a second Ctrl-C must not orphan children
            signal.signal(stop_signal, signal.SIG_IGN)
        supervisor.stop()


def cmd_exec(command: list[str]) -> int:
    os.execvp(command[0], command)
    return 1  # unreachable


def job_fields(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The job fields given on the command line (each task line may override them)."""
    sampling = dict(args.sampling or {})
    if args.model:
        sampling["model"] = args.model
    fields = {"sampling": sampling, "agent": args.agent, "timeouts": args.timeouts}
    return {name: value for name, value in fields.items() if value}


def cmd_submit(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rollout_service.sdk.client import RolloutClient

    settings = get_settings()
    tasks = []
    for number, line in enumerate(Path(args.file).read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except ValueError as exc:
                raise ConfigError(f"{args.file}:{number} is not JSON: {exc}") from exc
    defaults = job_fields(args)
    url = args.url or f"http://{local_address(settings)}:{settings.port}"
    out = open(args.output, "w") if args.output else sys.stdout
    with RolloutClient(url, token=settings.api_token or None) as client:
        job_ids = []
        for spec in tasks:
            body = dict(spec) if "task" in spec else {"task": spec}
            body["task"] = {**(args.task or {}), **body["task"]}
            for name, value in defaults.items():
                body[name] = {**value, **(body.get(name) or {})}
            job_ids += client.submit(body.pop("task"), n=args.n, **body).job_ids
        bar = tqdm(total=len(job_ids), unit="job", file=sys.stderr)

        def done(view: JobView) -> None:
            bar.update(1)
            out.write(json.dumps(view.model_dump(mode="json")) + "\n")

        views = client.wait(job_ids, timeout_s=args.timeout_s, on_done=done)
        bar.close()
    rewards = [v.reward for v in views if v.reward is not None]
    print(
        f"{len(views)} jobs: "
        + ", ".join(f"{s} {sum(v.status.value == s for v in views)}" for s in sorted({v.status.value for v in views}))
        + (f"; mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""),
        file=sys.stderr,
    )
    unsuccessful = [v for v in views if v.status.value in FAILED_STATUSES]
    for view in unsuccessful[:20]:
        reason = f"{view.error.code}: {view.error.message}" if view.error else view.finish_reason or ""
        print(f"  {view.job_id} {view.status.value} {reason}", file=sys.stderr)
    if len(unsuccessful) > 20:
        print(f"  ... and {len(unsuccessful) - 20} more", file=sys.stderr)
    return 1 if unsuccessful else 0


def cmd_reap(args: argparse.Namespace) -> int:
    from rollout_service.sandbox import reap_expired
    from rollout_service.state.connection import redis_client

    host = None if args.all_hosts else _hostname()
    while True:
        try:
            reaped = reap_expired(redis_client(), host)
        except redis.RedisError as exc:
            if not args.every_s:
                raise ConfigError(f"cannot reach Redis to reap: {exc}; check ROLLOUT_REDIS_URL") from exc
            print(f"rollout-service reap: {exc}; retrying in {args.every_s} s", file=sys.stderr, flush=True)
            reaped = []
        if reaped or not args.every_s:
            print(json.dumps({"reaped": reaped}), flush=True)
        if not args.every_s:
            return 0
        time.sleep(args.every_s)


def _hostname() -> str:
    import socket

    return socket.gethostname()


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); give an object, e.g. '{{\"temperature\": 0.7}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}: {text}")
    return value


def autoscale_range(text: str) -> tuple[int, int]:
    try:
        high, low = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MAX,MIN (two integers, e.g. 16,2)") from None
    if not 0 <= low <= high or high == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: need MAX >= MIN >= 0 and MAX > 0")
    return high, low


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start redis, gateway, workers, flower and the reference backend")
    up.add_argument("--redis-port", type=int, default=None, help="port of the embedded redis (default: free)")
    up.add_argument("--no-reference", action="store_true", help="do not start a backend")
    up.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="serve ROLLOUT_REFERENCE_MODEL with the project's reference server or vLLM's CPU build "
        "(`make vllm`); default ROLLOUT_ENGINE (reference)",
    )
    up.add_argument(
        "--run-workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="run worker processes to start (each ROLLOUT_RUN_CONCURRENCY greenlets); "
        "default ROLLOUT_RUN_WORKERS, the number of cores",
    )
    up.add_argument(
        "--init-workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="init worker processes to start (each ROLLOUT_INIT_CONCURRENCY greenlets)",
    )
    sub.add_parser("gateway", help="serve the HTTP gateway under gunicorn")
    worker = sub.add_parser("worker", help="run the Celery worker pool of one queue")
    worker.add_argument("queue", choices=sorted(WORKER_POOLS))
    worker.add_argument(
        "--pool",
        choices=POOL_KINDS,
        default=None,
        help="default: gevent for init and run, prefork for eval, threads for control",
    )
    sizing = worker.add_mutually_exclusive_group()
    sizing.add_argument(
        "--concurrency", type=positive_int, default=None, metavar="N", help="default: ROLLOUT_<QUEUE>_CONCURRENCY"
    )
    sizing.add_argument(
        "--autoscale",
        type=autoscale_range,
        default=None,
        metavar="MAX,MIN",
        help="grow and shrink between MIN and MAX (prefork or gevent pools)",
    )
    worker.add_argument(
        "--hostname",
        default=None,
        metavar="NAME",
        help="Celery node name (default <queue>-<random>@<host>, unique per process)",
    )
    sub.add_parser("flower", help="serve Flower (Celery monitoring)")
    sub.add_parser(
        "reference-server", help="serve a HF model or a script over the vLLM/SGLang token APIs", add_help=False
    )
    submit = sub.add_parser(
        "submit",
        help="submit a JSONL file of tasks and wait for them; exit 1 if any job failed, timed out or was cancelled",
    )
    submit.add_argument("file")
    submit.add_argument("--n", type=positive_int, default=1, help="rollouts per task (a GRPO group)")
    submit.add_argument("--url", default=None, help="gateway URL (default: localhost:ROLLOUT_PORT)")
    submit.add_argument("--output", default=None, help="write one JSON job view per line here")
    submit.add_argument("--timeout-s", type=float, default=3600.0)
    submit.add_argument("--model", default=None, help="sampling.model: the backend pool to use")
    submit.add_argument(
        "--task",
        type=json_object,
        default=None,
        metavar="JSON",
        help='fields each task gets unless it has them, e.g. \'{"domain": "swe", "image_template": '
        '"docker://swebench/sweb.eval.x86_64.{instance_id}:latest"}\' for SWE-bench rows',
    )
    for name in ("sampling", "agent", "timeouts"):
        submit.add_argument(
            f"--{name}",
            type=json_object,
            default=None,
            metavar="JSON",
            help=f"the job's {name} object (a task line's own {name} keys win)",
        )
    reap = sub.add_parser("reap", help="kill sandboxes that outlived their expiry")
    reap.add_argument("--all-hosts", action="store_true")
    reap.add_argument(
        "--every-s",
        type=float,
        default=None,
        metavar="S",
        help="keep reaping every S seconds (a reaper beside the workers of a container)",
    )
    harness = sub.add_parser("harness", help="prepare harness environments (agent.harness.env_dir)")
    harness_sub = harness.add_subparsers(dest="harness_command", required=True)
    install = harness_sub.add_parser("install", help="make a virtualenv with a preset's packages (and more)")
    install.add_argument("name", help="a preset (mini-swe-agent) or any name with --package")
    install.add_argument(
        "--into", default=None, help="the environment's directory (default: ROLLOUT_STATE_DIR/harnesses/NAME)"
    )
    install.add_argument("--package", action="append", default=[], metavar="SPEC", help="one more pip requirement")
    images = sub.add_parser("images", help="this node's image cache: pull (fetch and unpack) images ahead of a run")
    images_sub = images.add_subparsers(dest="images_command", required=True)
    pull = images_sub.add_parser(
        "pull", help="fetch and unpack images into this node's cache (once per digest); one JSON line each"
    )
    pull.add_argument(
        "images", nargs="*", metavar="IMAGE", help="docker://REF, oci:DIR[:TAG], oci-archive:FILE[:TAG], ..."
    )
    pull.add_argument(
        "--rows",
        default=None,
        metavar="FILE",
        help="a JSONL file of swe tasks (SWE-bench rows): pull each one's image (task.image or "
        "ROLLOUT_SWE_IMAGE_TEMPLATE) and pin its repository at base_commit as an agent's sandbox will",
    )
    pull.add_argument(
        "--shard", default="0/1", metavar="I/N", help="only every N-th image, from the I-th (Slurm arrays)"
    )
    images_sub.add_parser("list", help="the unpacked images of this node, one JSON line each")
    images_sub.add_parser("gc", help="evict least recently used images beyond ROLLOUT_IMAGE_CACHE_MAX_GB")
    return parser


def cmd_images(args: argparse.Namespace) -> int:
    from rollout_service.images import image_cache, parse_image

    cache = image_cache()
    if args.images_command == "list":
        for entry in cache.entries():
            print(json.dumps(entry))
        return 0
    if args.images_command == "gc":
        print(json.dumps({"evicted": cache.evict()}))
        return 0
    wanted = [(image, None) for image in args.images] + (_row_images(args.rows) if args.rows else [])
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ConfigError(
            f"--shard {args.shard!r}: give I/N with 0 <= I < N, e.g. $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT"
        )
    failed = 0
    for image, pin in wanted[int(index) :: int(count)]:
        began = time.monotonic()
        try:
            ref = parse_image(image, "image")
            cached = cache.is_unpacked(cache.digest(ref))
            rootfs = cache.resolve(ref)
            if pin is not None:
                from rollout_service.sandbox.image_root import pinned_repo_layer

                pinned_repo_layer(rootfs, *pin)
        except RolloutError as exc:
            failed += 1
            print(json.dumps({"image": image, "error": exc.to_dict()}), flush=True)
            continue
        line = {
            "image": image,
            "digest": rootfs.digest,
            "cached": cached,
            "seconds": round(time.monotonic() - began, 3),
        }
        print(json.dumps({**line, **({"pinned": list(pin)} if pin else {})}), flush=True)
    return 1 if failed else 0


def _row_images(path: str) -> list[tuple[str, tuple[str, str] | None]]:
    from rollout_service.tasks.swe import SweHandler, task_image

    found: list[tuple[str, tuple[str, str] | None]] = []
    with open(path) as rows:
        for number, line in enumerate(rows, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            row = row.get("task", row)
            image = task_image(row)
            if image is None:
                raise ConfigError(f"{path}:{number}: the row has no image and ROLLOUT_SWE_IMAGE_TEMPLATE is not set")
            found.append((image, (SweHandler.repo_dir(row), row["base_commit"]) if row.get("base_commit") else None))
    return found


def cmd_harness(args: argparse.Namespace) -> int:
    from rollout_service.runtime.harness_presets import install

    target = install(args.name, args.into, tuple(args.package))
    print(f'{target}\nuse it with: "agent": {{"harness": {{"env_dir": "{target}", ...}}}}')
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reference-server"]:
        from rollout_service.devtools.reference_server import main as reference_main

        reference_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    settings = get_settings()
    try:
        if args.command == "up":
            return cmd_up(args)
        if args.command == "gateway":
            return cmd_exec(gateway_command(settings))
        if args.command == "worker":
            options = WorkerOptions(args.pool, args.concurrency, args.autoscale, args.hostname)
            return cmd_exec(worker_command(settings, args.queue, options))
        if args.command == "flower":
            return cmd_exec(flower_command(settings))
        if args.command == "submit":
            return cmd_submit(args)
        if args.command == "reap":
            return cmd_reap(args)
        if args.command == "harness":
            return cmd_harness(args)
        if args.command == "images":
            return cmd_images(args)
    except RolloutError as exc:
        print(f"rollout-service: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
