"""``rollout-service``: run the whole service (``up``) or single pieces, submit tasks, reap."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx

from rollout_service.errors import ConfigError, RolloutError
from rollout_service.settings import Settings, get_settings

WORKER_POOLS = {  # queue -> (celery pool, settings field with its concurrency)
    "init": ("threads", "init_concurrency"),
    "run": ("gevent", "run_concurrency"),
    "eval": ("prefork", "eval_concurrency"),
    "control": ("threads", "control_concurrency"),
}


def gateway_command(settings: Settings, bind: str = "0.0.0.0") -> list[str]:
    return [sys.executable, "-m", "gunicorn", "--workers", str(settings.gateway_workers),
            "--threads", "8", "--bind", f"{bind}:{settings.port}", "--timeout", "120",
            "--graceful-timeout", "10", "rollout_service.gateway:create_app()"]


def worker_command(settings: Settings, queue: str) -> list[str]:
    if queue not in WORKER_POOLS:
        raise ConfigError(f"unknown queue {queue!r}; valid: {', '.join(WORKER_POOLS)}")
    pool, concurrency_field = WORKER_POOLS[queue]
    return [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", queue,
            "-P", pool, "-c", str(getattr(settings, concurrency_field)), "-n", f"{queue}@%h",
            "--loglevel", "INFO", "-E", "--without-gossip", "--without-mingle"]


def flower_command(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "workers.celery_app", "flower",
            f"--port={settings.flower_port}", "--address=0.0.0.0"]


def reference_command(settings: Settings, model_dir: Path) -> list[str]:
    return [sys.executable, "-m", "rollout_service.reference_server", "--model", str(model_dir),
            "--port", str(settings.reference_port), "--host", "127.0.0.1"]


@dataclass
class Child:
    name: str
    process: subprocess.Popen


class Supervisor:
    """Starts the pieces as separate processes, logs each to a file, stops them all together."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, command: list[str]) -> Child:
        log = open(self.log_dir / f"{name}.log", "ab")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        child = Child(name, process)
        self.children.append(child)
        return child

    def check(self) -> None:
        for child in self.children:
            if child.process.poll() is not None:
                tail = (self.log_dir / f"{child.name}.log").read_text(errors="replace")[-3000:]
                raise ConfigError(f"{child.name} exited with code {child.process.returncode}; "
                                  f"last log lines:\n{tail}")

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in reversed(self.children):
            try:
                child.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()


def wait_http(url: str, supervisor: Supervisor, timeout_s: float, ok: tuple[int, ...] = (200,)) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        supervisor.check()
        try:
            if httpx.get(url, timeout=2).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise ConfigError(f"{url} did not become ready within {timeout_s:.0f} s; see logs in {supervisor.log_dir}")


def cmd_up(args: argparse.Namespace) -> int:
    from rollout_service.redis_server import RedisServer
    from rollout_service.tiny_model import build_tiny_model

    settings = get_settings()
    state = settings.state_path
    state.mkdir(parents=True, exist_ok=True)
    redis_server: Optional[RedisServer] = None
    redis_url = settings.redis_url
    if not redis_url:
        redis_server = RedisServer(state / "redis", port=args.redis_port).start()
        redis_url = redis_server.url
    (state / "redis.url").write_text(redis_url)
    env = {**os.environ, "ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_STATE_DIR": str(state)}
    supervisor = Supervisor(state / "logs", env)
    stop_now = lambda *_: (_ for _ in ()).throw(KeyboardInterrupt())  # noqa: E731
    signal.signal(signal.SIGTERM, stop_now)
    try:
        model_dir = Path(settings.reference_model) if settings.reference_model else None
        if model_dir is None and not args.no_reference:
            print("building the tiny reference model (once) ...", flush=True)
            model_dir = build_tiny_model(state / "models" / "tiny")
        if model_dir is not None and not args.no_reference:
            supervisor.start("reference", reference_command(settings, model_dir))
        supervisor.start("gateway", gateway_command(settings))
        for queue in WORKER_POOLS:
            supervisor.start(f"worker-{queue}", worker_command(settings, queue))
        supervisor.start("flower", flower_command(settings))
        gateway = f"http://127.0.0.1:{settings.port}"
        wait_http(f"{gateway}/healthz", supervisor, 60)
        if model_dir is not None and not args.no_reference:
            reference = f"http://127.0.0.1:{settings.reference_port}"
            wait_http(f"{reference}/health", supervisor, 120)
            headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
            httpx.post(f"{gateway}/v1/backends", headers=headers, timeout=10, json={
                "url": reference, "kind": "reference", "model": "tiny", "tokenizer": str(model_dir)},
            ).raise_for_status()
        wait_http(f"{gateway}/readyz", supervisor, 120)
        wait_http(f"http://127.0.0.1:{settings.flower_port}/healthcheck", supervisor, 60)
        print(f"rollout-service is up (Ctrl-C stops everything)\n"
              f"  gateway    {gateway}   (try {gateway}/v1/backends, {gateway}/ui/)\n"
              f"  flower     http://127.0.0.1:{settings.flower_port}\n"
              f"  reference  http://127.0.0.1:{settings.reference_port}  (model 'tiny')\n"
              f"  redis      {redis_url}\n"
              f"  logs       {supervisor.log_dir}", flush=True)
        while True:
            supervisor.check()
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        supervisor.stop()
        if redis_server:
            redis_server.stop()


def cmd_exec(command: list[str]) -> int:
    os.execvp(command[0], command)
    return 1  # unreachable


def cmd_submit(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rollout_service.client import RolloutClient

    settings = get_settings()
    tasks = []
    for number, line in enumerate(Path(args.file).read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except ValueError as exc:
                raise ConfigError(f"{args.file}:{number} is not JSON: {exc}") from exc
    url = args.url or f"http://127.0.0.1:{settings.port}"
    out = open(args.output, "w") if args.output else sys.stdout
    with RolloutClient(url, token=settings.api_token or None) as client:
        job_ids = []
        for spec in tasks:
            body = spec if "task" in spec else {"task": spec}
            job_ids += client.submit(body.pop("task"), n=args.n, **body).job_ids
        bar = tqdm(total=len(job_ids), unit="job", file=sys.stderr)

        def done(view: object) -> None:
            bar.update(1)
            out.write(json.dumps(view.model_dump(mode="json")) + "\n")  # type: ignore[attr-defined]

        views = client.wait(job_ids, timeout_s=args.timeout_s, on_done=done)
        bar.close()
    rewards = [v.reward for v in views if v.reward is not None]
    print(f"{len(views)} jobs: " + ", ".join(f"{s} {sum(v.status.value == s for v in views)}"
          for s in sorted({v.status.value for v in views})) +
          (f"; mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""), file=sys.stderr)
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    from rollout_service.sandbox import reap_expired
    from rollout_service.store import redis_client

    reaped = reap_expired(redis_client(), None if args.all_hosts else _hostname())
    print(json.dumps({"reaped": reaped}))
    return 0


def _hostname() -> str:
    import socket

    return socket.gethostname()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start redis, gateway, workers, flower and the reference backend")
    up.add_argument("--redis-port", type=int, default=None, help="port of the embedded redis (default: free)")
    up.add_argument("--no-reference", action="store_true", help="do not start the reference backend")
    sub.add_parser("gateway", help="serve the HTTP gateway under gunicorn")
    worker = sub.add_parser("worker", help="run the Celery worker pool of one queue")
    worker.add_argument("queue", choices=sorted(WORKER_POOLS))
    sub.add_parser("flower", help="serve Flower (Celery monitoring)")
    sub.add_parser("reference-server", help="serve a HF model or a script over the vLLM/SGLang token APIs",
                   add_help=False)
    submit = sub.add_parser("submit", help="submit a JSONL file of tasks and wait for them")
    submit.add_argument("file")
    submit.add_argument("--n", type=int, default=1, help="rollouts per task (a GRPO group)")
    submit.add_argument("--url", default=None, help="gateway URL (default: localhost:ROLLOUT_PORT)")
    submit.add_argument("--output", default=None, help="write one JSON job view per line here")
    submit.add_argument("--timeout-s", type=float, default=3600.0)
    reap = sub.add_parser("reap", help="kill sandboxes that outlived their expiry")
    reap.add_argument("--all-hosts", action="store_true")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reference-server"]:
        from rollout_service.reference_server import main as reference_main

        return reference_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    settings = get_settings()
    try:
        if args.command == "up":
            return cmd_up(args)
        if args.command == "gateway":
            return cmd_exec(gateway_command(settings))
        if args.command == "worker":
            return cmd_exec(worker_command(settings, args.queue))
        if args.command == "flower":
            return cmd_exec(flower_command(settings))
        if args.command == "submit":
            return cmd_submit(args)
        if args.command == "reap":
            return cmd_reap(args)
    except RolloutError as exc:
        print(f"rollout-service: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
