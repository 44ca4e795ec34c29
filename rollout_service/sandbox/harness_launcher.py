"""Runs a job's external agent harness inside its sandbox (stdlib only).

The sandbox has no network, but it has its own loopback: this launcher listens on
127.0.0.1:<free port> and relays every connection to the job's endpoint, a Unix socket the run
worker serves in the bound socket directory. The harness gets ``OPENAI_BASE_URL`` (and LiteLLM's
``OPENAI_API_BASE``) ``=http://127.0.0.1:<port>/v1`` and ``ANTHROPIC_BASE_URL=http://127.0.0.1:<port>``,
so OpenAI and Anthropic clients work unchanged. ``--env-dir`` (the harness's environment) goes
first on its PATH; a program not found is reported once, with the PATH searched.

The harness's final answer is what it writes to ``$ROLLOUT_ANSWER_FILE`` (a path in the sandbox's
own socket directory, made for this attempt and removed with the sandbox); else, if it exits by
itself, what a preset's agent left in its JSON file (``--answer-json``), else the last non-empty
line of its stdout. A harness stopped before it wrote the file has no answer. The launcher stops
the harness (its whole process group) when the stop file appears or its deadline passes, and ends
with one line ``RESULT_MARKER {"exit_code", "answer", "stopped", "error"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

RESULT_MARKER = "ROLLOUT_HARNESS_RESULT"
POLL_S = 0.1
MAX_ANSWER_BYTES = 1 << 20


def pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def relay(client: socket.socket, unix_path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(unix_path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def serve_forwarder(listener: socket.socket, unix_path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=relay, args=(client, unix_path), daemon=True).start()


def run(command: list[str], env: dict[str, str], stop_file: str, deadline_s: float) -> tuple[int, str | None, str]:
    """(exit code, why it was stopped or None, last non-empty stdout line)."""
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, start_new_session=True)
    last_line = [""]

    def copy_stdout() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            if line.strip():
                last_line[0] = line.decode("utf-8", "replace").strip()

    copier = threading.Thread(target=copy_stdout, daemon=True)
    copier.start()
    ends_at = time.monotonic() + deadline_s
    stopped: str | None = None
    while child.poll() is None:
        if os.path.exists(stop_file):
            stopped = "stopped"
        elif time.monotonic() >= ends_at:
            stopped = "deadline"
        if stopped:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
            child.wait()
            break
        time.sleep(POLL_S)
    copier.join(timeout=2.0)
    return child.returncode, stopped, last_line[0]


def locate(program: str, path: str, env_dir: str | None) -> tuple[str | None, str]:
    """(the program's path, "") or (None, why it cannot be run: what was looked for, and where)."""
    if "/" in program:
        found = program if os.path.isfile(program) and os.access(program, os.X_OK) else None
        missing = f"the harness program {program} does not exist in the sandbox or is not executable"
        return found, "" if found else missing
    found = shutil.which(program, path=path)
    if found:
        return found, ""
    hint = (
        f"the environment {env_dir} has no bin/{program}"
        if env_dir
        else "name a prepared environment that provides it in agent.harness.env_dir (rollout-service harness install)"
    )
    return None, f"the harness program {program!r} was not found on the sandbox's PATH ({path}); {hint}"


def answer_from_json(spec: list | None) -> str | None:
    """The answer a preset's agent left in a JSON file: ``[path, [key, ...]]``."""
    if not spec:
        return None
    path, keys = spec
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
        for key in keys:
            value = value[key]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return value.strip() if isinstance(value, str) else None


def harness_env(args: argparse.Namespace, port: int) -> dict[str, str]:
    extra = json.loads(args.env_json)
    env = {**os.environ, **extra}
    if args.env_dir:
        env["PATH"] = f"{args.env_dir}/bin:{env.get('PATH', os.defpath)}"
        if os.path.isfile(os.path.join(args.env_dir, "pyvenv.cfg")):
            env["VIRTUAL_ENV"] = args.env_dir
    base = f"http://127.0.0.1:{port}"
    env.update(
        {
            "OPENAI_BASE_URL": f"{base}/v1",
            "OPENAI_API_BASE": f"{base}/v1",
            "ANTHROPIC_BASE_URL": base,
            "ROLLOUT_ANSWER_FILE": args.answer_file,
        }
    )
    if "OPENAI_API_KEY" in env:
        env.setdefault("ANTHROPIC_API_KEY", env["OPENAI_API_KEY"])
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, help="the job's endpoint (Unix socket)")
    parser.add_argument("--stop-file", required=True, help="the harness is killed once this file exists")
    parser.add_argument("--answer-file", required=True)
    parser.add_argument("--answer-json", default="null", help="[path, [key, ...]]: where a preset's answer is")
    parser.add_argument("--deadline-s", type=float, required=True)
    parser.add_argument("--env-json", default="{}", help="extra environment of the harness")
    parser.add_argument("--env-dir", default="", help="the harness's environment: its bin/ goes first on PATH")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    threading.Thread(target=serve_forwarder, args=(listener, args.socket), daemon=True).start()
    env = harness_env(args, listener.getsockname()[1])
    program, error = locate(command[0], env["PATH"], args.env_dir or None)
    exit_code, stopped, last_line = 127, None, ""
    if program is not None:
        try:
            exit_code, stopped, last_line = run([program, *command[1:]], env, args.stop_file, args.deadline_s)
        except OSError as exc:
            error = f"cannot start the harness program {command[0]!r} ({program}): {exc.strerror or exc}"
    answer = last_line if stopped is None else ""
    if stopped is None and (from_json := answer_from_json(json.loads(args.answer_json))) is not None:
        answer = from_json
    if os.path.isfile(args.answer_file):
        with open(args.answer_file, "rb") as f:
            answer = f.read(MAX_ANSWER_BYTES).decode("utf-8", "replace").strip()
    result = {"exit_code": exit_code, "answer": answer, "stopped": stopped, "error": error or None}
    sys.stdout.write(f"\n{RESULT_MARKER} {json.dumps(result)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
