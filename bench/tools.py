"""Tool-call latency through the full path, against a tmux baseline measured in the same run.

    .venv/bin/python bench/tools.py [--sandbox bwrap] [--n 300] [--json]

Full path: ``Sandbox.execute`` (worker side) -> Unix socket -> action server in the sandbox ->
the tool (pty bash / IPython kernel) -> back. Boot: ``start()`` until the action server has
answered its first request. Baseline: bash in tmux driven by ``send-keys`` + ``capture-pane``
polling, as OpenHands' runtime does (clear the screen and wait 0.1 s, send, then capture every
0.5 s until the prompt marker shows), plus a best case of the same that polls every 5 ms.
The baseline runs on the host, without a sandbox, so it is a lower bound for tmux.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_service.sandbox import SandboxSpec, create_sandbox  # noqa: E402


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    p50 = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return p50 * 1000, p90 * 1000


def expect(observation: dict, output: str) -> None:
    if observation["output"] != output:
        raise SystemExit(f"wrong observation {observation!r}; expected output {output!r}")


def timed(call: Callable[[], object], n: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


class TmuxShell:
    """bash in a detached tmux session; completion seen as a new prompt marker on the screen."""

    MARKER = "#PS1-DONE#"

    def __init__(self, workdir: str) -> None:
        self.socket = os.path.join(workdir, "tmux.sock")
        self.session = "bench"
        self._tmux("new-session", "-d", "-s", self.session, "-x", "200", "-y", "50",
                   "bash --norc --noprofile")  # fmt: skip
        self._tmux("send-keys", "-t", self.session, f"PS1='{self.MARKER}\\n'; clear", "Enter")
        self._wait_for(1, poll_s=0.01)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def _markers(self) -> int:
        return self._tmux("capture-pane", "-p", "-J", "-t", self.session).count(self.MARKER)

    def _wait_for(self, count: int, poll_s: float) -> None:
        while self._markers() < count:
            time.sleep(poll_s)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


def tmux_command_latency(command: str, n: int, poll_s: float, clear_s: float) -> list[float]:
    """Time from sending the command to seeing its prompt (the screen reset before is not counted,
    except the fixed wait after the clear that OpenHands makes)."""
    workdir = tempfile.mkdtemp(prefix="bench-tmux-")
    shell = TmuxShell(workdir)
    try:
        samples = []
        for _ in range(n):
            shell._tmux("send-keys", "-t", shell.session, "clear", "Enter")
            shell._wait_for(1, 0.002)
            started = time.perf_counter()
            if clear_s:
                time.sleep(clear_s)
            shell._tmux("send-keys", "-t", shell.session, command, "Enter")
            while shell._markers() < 2:
                time.sleep(poll_s)
            samples.append(time.perf_counter() - started)
        return samples
    finally:
        shell.close()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandbox", default="bwrap")
    parser.add_argument("--n", type=int, default=300, help="calls per tool")
    parser.add_argument("--boots", type=int, default=20)
    parser.add_argument("--tmux-n", type=int, default=20, help="calls for the 0.5 s-polling baseline")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="bench-tools-")
    boots = []
    for i in range(args.boots):
        workspace = os.path.join(workdir, f"boot{i}")
        os.mkdir(workspace)
        box = create_sandbox(args.sandbox, SandboxSpec("bench", workspace, tools=("bash", "editor", "finish")))
        box.start()
        boots.append(box.boot_s)
        box.stop()

    boots_all = []
    for i in range(args.boots):
        workspace = os.path.join(workdir, f"boot-all{i}")
        os.mkdir(workspace)
        box = create_sandbox(args.sandbox, SandboxSpec("bench", workspace))
        box.start()
        boots_all.append(box.boot_s)
        box.stop()

    workspace = os.path.join(workdir, "tools")
    os.mkdir(workspace)
    box = create_sandbox(args.sandbox, SandboxSpec("bench", workspace))
    box.start()
    try:
        box.execute("ipython", {"code": "0"}, 120)  # wait for the kernel started at boot
        bash = timed(lambda: expect(box.execute("bash", {"command": "echo hi"}, 30), "hi"), args.n)
        bash_fork = timed(lambda: expect(box.execute("bash", {"command": "ls -d /"}, 30), "/"), args.n)
        ipython = timed(lambda: expect(box.execute("ipython", {"code": "1 + 1"}, 30), "2"), args.n)
    finally:
        box.stop()
    shutil.rmtree(workdir, ignore_errors=True)

    tmux_tight = tmux_command_latency("echo hi", args.n // 3, poll_s=0.005, clear_s=0.0)
    tmux_openhands = tmux_command_latency("echo hi", args.tmux_n, poll_s=0.5, clear_s=0.1)

    result: dict[str, float | int | str] = {"sandbox": args.sandbox, "n": args.n}
    rows = [
        ("sandbox boot to first answer", boots, "boot"),
        ("  same, IPython kernel launched at boot", boots_all, "boot_with_ipython"),
        ("bash `echo hi`, full path", bash, "bash"),
        ("bash `ls -d /` (forks), full path", bash_fork, "bash_fork"),
        ("IPython `1 + 1`, full path", ipython, "ipython"),
        ("tmux bash, OpenHands-style polling", tmux_openhands, "tmux_openhands"),
        ("tmux bash, 5 ms polling (best case)", tmux_tight, "tmux_tight"),
    ]
    print(f"{'what':40} {'p50 ms':>9} {'p90 ms':>9} {'n':>5}")
    for label, samples, key in rows:
        p50, p90 = percentiles(samples)
        result[f"{key}_p50_ms"] = round(p50, 3)
        result[f"{key}_p90_ms"] = round(p90, 3)
        print(f"{label:40} {p50:9.2f} {p90:9.2f} {len(samples):5}")
    result["bash_speedup_vs_tmux_openhands"] = round(result["tmux_openhands_p50_ms"] / result["bash_p50_ms"], 1)
    result["bash_speedup_vs_tmux_tight"] = round(result["tmux_tight_p50_ms"] / result["bash_p50_ms"], 1)
    print(
        f"bash is {result['bash_speedup_vs_tmux_openhands']}x faster than OpenHands-style tmux "
        f"and {result['bash_speedup_vs_tmux_tight']}x faster than tmux polled every 5 ms"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
