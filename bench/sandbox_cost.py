"""What a sandboxed rollout costs the machine, part by part: machine CPU from /proc/stat.

    .venv/bin/python bench/sandbox_cost.py [--sandboxes 200] [--gradings 200] [--json]

Agent sandboxes: ``--sandboxes`` started at once from one gevent-patched process, as a run
worker starts them (in the background, through the fork server when root), each answering one
``bash`` command; then one more command each; then all stopped. Gradings: ``--gradings`` code
submissions graded by ``CodeHandler.score`` (a fresh one-shot sandbox each), ``--parallel`` at a
time, as eval's prefork children grade, and as many grading sandboxes that run nothing but
Python's ``__hello__`` (what a grading costs before its test). Each part reports the whole
machine's busy CPU per sandbox (every process, the sandboxes' own included) and its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMMAND = {"command": "echo hi"}
TASK = {"domain": "code", "text": "write f", "test_list": ["assert f() == 1"]}
SUBMISSION = {"answer": "def f():\n    return 1\n"}


def machine_busy_s() -> float:
    values = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def measured(count: int, work: Callable[[], Any], settle_s: float = 0.0) -> tuple[dict[str, float], Any]:
    """Machine CPU per item (ms) and wall time of ``work``; ``settle_s`` of waiting is included in
    the CPU window (teardown that finishes after the call returns) but not in the wall time."""
    busy, started = machine_busy_s(), time.monotonic()
    result = work()
    wall_s = time.monotonic() - started
    time.sleep(settle_s)
    return {
        "machine_cpu_ms_each": round((machine_busy_s() - busy) / count * 1e3, 2),
        "wall_s": round(wall_s, 3),
    }, result


def agent_sandboxes(count: int, workspace_root: str) -> dict[str, Any]:
    """In a gevent-patched process, as a run worker."""
    import gevent

    from rollout_service.sandbox import SandboxSpec, create_sandbox
    from rollout_service.sandbox.base import BackgroundStart
    from rollout_service.settings import get_settings

    settings = get_settings()

    def boot(n: int) -> Any:
        workspace = tempfile.mkdtemp(prefix=f"w{n}-", dir=workspace_root)
        sandbox = BackgroundStart(
            create_sandbox(
                settings.sandbox,
                SandboxSpec(
                    job_id=f"cost-{n}-{os.urandom(4).hex()}",
                    workspace=workspace,
                    tools=("bash", "finish"),
                    memory_mb=settings.sandbox_memory_mb,
                    cpu_time_s=settings.sandbox_cpu_time_s,
                    max_procs=settings.sandbox_max_procs,
                    ttl_s=300,
                ),
                None,
            )
        )
        assert "hi" in sandbox.execute("bash", COMMAND, timeout_s=30)["output"]
        return sandbox

    def command_each(sandboxes: list[Any]) -> None:
        gevent.joinall([gevent.spawn(s.execute, "bash", COMMAND, timeout_s=30) for s in sandboxes], raise_error=True)

    def stop_all(sandboxes: list[Any]) -> None:
        gevent.joinall([gevent.spawn(s.sandbox.stop) for s in sandboxes], raise_error=True)

    boot(-1).sandbox.stop()  # the fork server starts with the first sandbox
    booted, greenlets = measured(
        count, lambda: gevent.joinall([gevent.spawn(boot, n) for n in range(count)], raise_error=True)
    )
    sandboxes = [g.value for g in greenlets]
    command, _ = measured(count, lambda: command_each(sandboxes))
    stopped, _ = measured(count, lambda: stop_all(sandboxes), settle_s=0.5)
    return {"boot_and_first_command": booted, "one_more_command": command, "stop": stopped}


def gradings(count: int, parallel: int) -> dict[str, Any]:
    """In a plain process with ``parallel`` threads, as eval's prefork children grade."""
    from rollout_service.tasks import get_handler
    from rollout_service.tasks.sandboxed import grading_run, grading_workspace

    handler = get_handler("code")
    assert handler.score(TASK, SUBMISSION).reward == 1.0  # and the fork server is up

    def grade_all() -> list[float]:
        with ThreadPoolExecutor(parallel) as pool:
            return list(pool.map(lambda _: handler.score(TASK, SUBMISSION).reward, range(count)))

    graded, rewards = measured(count, grade_all)
    assert rewards == [1.0] * count, rewards

    def empty_sandbox() -> None:
        with grading_workspace("code", small=True) as workspace:
            _, output = grading_run(workspace, None, 10, ("module:__hello__",))
        assert "Hello world" in output, output

    def empty_all() -> None:
        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(lambda _: empty_sandbox(), range(count)))

    empty, _ = measured(count, empty_all)
    return {"grading": graded, "grading_sandbox_alone": empty}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sandboxes", type=int, default=200)
    parser.add_argument("--gradings", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=4, help="gradings at a time (eval's children)")
    parser.add_argument("--gradings-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.gradings_only:
        print(json.dumps(gradings(args.gradings, args.parallel)))
        return 0
    graded = subprocess.run(
        [
            sys.executable,
            __file__,
            "--gradings-only",
            "--gradings",
            str(args.gradings),
            "--parallel",
            str(args.parallel),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    from gevent import monkey

    monkey.patch_all()
    from rollout_service.settings import get_settings

    with tempfile.TemporaryDirectory(prefix="bench-sandbox-cost-", dir=get_settings().scratch_path) as root:
        result = {
            "bench": "sandbox_cost",
            "sandbox": get_settings().sandbox,
            "cores": os.cpu_count(),
            "sandboxes": args.sandboxes,
            **agent_sandboxes(args.sandboxes, root),
            "gradings": args.gradings,
            "parallel": args.parallel,
            **json.loads(graded.stdout.strip().splitlines()[-1]),
        }
    for part in ("boot_and_first_command", "one_more_command", "stop", "grading", "grading_sandbox_alone"):
        print(
            f"{part:24s} {result[part]['machine_cpu_ms_each']:6.2f} ms machine CPU each, "
            f"{result[part]['wall_s']:.3f} s for all"
        )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
