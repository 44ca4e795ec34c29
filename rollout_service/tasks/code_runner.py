"""Runs hidden tests against a code submission, inside a grading sandbox. Stdlib only.

    python code_runner.py /workspace/grading.json

``grading.json`` is ``{"program", "tests": [...], "timeout_s", "budget_s", "nonce"}``; the
runner reads it and deletes it (and itself) before any submitted code runs, so that code
cannot learn the nonce. Each test runs in its own child process and new session: the
program, then the test, then the child writes a fresh per-test token. A test passes only if
the child exits 0 *and* wrote its token, so ``sys.exit(0)`` or ``os._exit(0)`` in the
submission is a failure, not a pass. A child past its time is killed with its process group.
The last line printed is ``<nonce> <json list of {"status", "error"}>``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

STDERR_TAIL_BYTES = 2000
ERROR_CHARS = 160

CHILD = r"""
import json, os, sys
def _run():
    payload = json.loads(sys.stdin.read())
    sys.path.extend(payload.pop("site_paths"))
    token = payload.pop("token")
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    exec(compile(payload["program"], "solution.py", "exec"), namespace)
    exec(compile(payload["test"], "test.py", "exec"), namespace)
    os.write(1, ("\n" + token + "\n").encode())
_run()
"""


def forbid_inspection() -> None:
    """Other processes of this uid may not read our memory (where the nonce lives)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass


def tail(path: str, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - size))
        return f.read()


def last_error_line(stderr: bytes) -> str:
    lines = [line for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1].strip()[:ERROR_CHARS] if lines else ""


def run_test(program: str, test: str, timeout_s: float, scratch: str, python_flags: list, site_paths: list) -> dict:
    token = os.urandom(16).hex()
    out_path, err_path = os.path.join(scratch, "out"), os.path.join(scratch, "err")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        child = subprocess.Popen([sys.executable, *python_flags, "-c", CHILD], stdin=subprocess.PIPE, stdout=out,
                                 stderr=err, cwd=scratch, start_new_session=True)
    try:
        try:
            child.stdin.write(json.dumps({"program": program, "test": test, "token": token,
                                          "site_paths": site_paths}).encode())
            child.stdin.close()
        except BrokenPipeError:
            pass
        child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"did not finish within {timeout_s:g} s"}
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:
            pass
        child.wait()
    if child.returncode == 0 and tail(out_path, 64).rstrip(b"\n").endswith(token.encode()):
        return {"status": "passed", "error": ""}
    error = last_error_line(tail(err_path, STDERR_TAIL_BYTES))
    if child.returncode < 0:
        error = error or f"killed by signal {-child.returncode}"
    return {"status": "failed", "error": error or f"exited with code {child.returncode} before the test finished"}


def remove_tree(path: str) -> None:
    """shutil.rmtree(path, ignore_errors=True) without importing shutil (paid at every grading)."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass
        for name in dirs:
            try:
                os.rmdir(os.path.join(root, name))
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def main(payload_path: str) -> None:
    forbid_inspection()
    with open(payload_path) as f:
        payload = json.load(f)
    os.unlink(payload_path)
    try:
        os.unlink(os.path.abspath(__file__))
    except OSError:
        pass
    deadline = time.monotonic() + float(payload["budget_s"])
    results = []
    for test in payload["tests"]:
        remaining = deadline - time.monotonic()
        if remaining <= 0.05:
            results.append({"status": "not_run", "error": "the grading time budget was used up"})
            continue
        scratch = os.path.join(os.environ.get("TMPDIR") or "/tmp", f"test-{os.urandom(8).hex()}")
        os.mkdir(scratch, 0o700)
        try:
            results.append(run_test(payload["program"], test, min(float(payload["timeout_s"]), remaining),
                                    scratch, payload.get("python_flags", ["-I"]), payload.get("site_paths", [])))
        finally:
            remove_tree(scratch)
    print(f"\n{payload['nonce']} {json.dumps(results)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
