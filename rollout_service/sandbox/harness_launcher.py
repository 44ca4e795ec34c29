"""Runs a job's external agent harness inside its sandbox (stdlib only).

The sandbox has no network, but it has its own loopback: this launcher listens on
127.0.0.1:<free port> and relays every connection to the job's OpenAI-compatible endpoint,
a Unix socket the run worker serves in the bound socket directory. The harness gets
``OPENAI_BASE_URL=http://127.0.0.1:<port>/v1``, so any OpenAI client works unchanged.

The harness's final answer is what it writes to ``$ROLLOUT_ANSWER_FILE`` (a path in the sandbox's
own socket directory, made for this attempt and removed with the sandbox) or, if it writes nothing
there and exits by itself, the last non-empty line of its stdout; a harness stopped before it wrote
the file has no answer. The launcher stops the harness (its
whole process group) when the stop file appears or its deadline passes, and ends with one
line ``RESULT_MARKER {"exit_code", "answer", "stopped"}``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

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


def run(command: list[str], env: dict[str, str], stop_file: str, deadline_s: float) -> tuple[int, Optional[str], str]:
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
    stopped: Optional[str] = None
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


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, help="the job's OpenAI endpoint (Unix socket)")
    parser.add_argument("--stop-file", required=True, help="the harness is killed once this file exists")
    parser.add_argument("--answer-file", required=True)
    parser.add_argument("--deadline-s", type=float, required=True)
    parser.add_argument("--env-json", default="{}", help="extra environment of the harness")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    threading.Thread(target=serve_forwarder, args=(listener, args.socket), daemon=True).start()
    env = {**os.environ, **json.loads(args.env_json),
           "OPENAI_BASE_URL": f"http://127.0.0.1:{listener.getsockname()[1]}/v1",
           "ROLLOUT_ANSWER_FILE": args.answer_file}
    try:
        exit_code, stopped, last_line = run(command, env, args.stop_file, args.deadline_s)
    except OSError as exc:  # e.g. the program does not exist
        exit_code, stopped, last_line = 127, None, ""
        print(f"cannot start the harness {command!r}: {exc}", file=sys.stderr)
    answer = last_line if stopped is None else ""
    if os.path.isfile(args.answer_file):
        with open(args.answer_file, "rb") as f:
            answer = f.read(MAX_ANSWER_BYTES).decode("utf-8", "replace").strip()
    result = {"exit_code": exit_code, "answer": answer, "stopped": stopped}
    sys.stdout.write(f"\n{RESULT_MARKER} {json.dumps(result)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
