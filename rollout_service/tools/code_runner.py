"""Runs hidden tests against a code submission, inside a grading sandbox. Stdlib only.

    SandboxSpec(script=("module:rollout_service.tools.code_runner", "/workspace/grading.json"))

``grading.json`` is ``{"program", "tests": [...], "timeout_s", "budget_s", "nonce"}``; the
runner reads it and deletes it before any submitted code runs. Each test runs in
a forked child in a new session, with nothing open but its own output files: the nonce is in
its memory, but the result pipe is closed in it and the runner cannot be inspected
(PR_SET_DUMPABLE 0), so it cannot print the last line. The child runs the program, then the
test, then writes a fresh per-test token. A test passes only if
the child exits 0 *and* wrote its token, so ``sys.exit(0)`` or ``os._exit(0)`` in the
submission is a failure, not a pass. A child past its time is killed with its process group.
The last line printed is ``<nonce> <json list of {"status", "error"}>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from rollout_service.tools.confine import exit_status

STDERR_TAIL_BYTES = 2000
ERROR_CHARS = 160

MAX_FD = 1 << 20


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


def run_test(program: str, test: str, timeout_s: float, scratch: str, site_paths: list) -> dict:
    token = os.urandom(16).hex()
    out_path, err_path = os.path.join(scratch, "out"), os.path.join(scratch, "err")
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        run_child(program, test, token, out, err, scratch, site_paths)
    os.close(out)
    os.close(err)
    code = None
    try:
        code = wait_for(child, timeout_s)
    finally:
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass
        if code is None:
            os.waitpid(child, 0)
    if code is None:
        return {"status": "timeout", "error": f"did not finish within {timeout_s:g} s"}
    if code == 0 and tail(out_path, 64).rstrip(b"\n").endswith(token.encode()):
        return {"status": "passed", "error": ""}
    error = last_error_line(tail(err_path, STDERR_TAIL_BYTES))
    if code < 0:
        error = error or f"killed by signal {-code}"
    return {"status": "failed", "error": error or f"exited with code {code} before the test finished"}


def run_child(program: str, test: str, token: str, out: int, err: int, scratch: str, site_paths: list) -> None:
    """In a forked child, in its own session: the program, then the test, then the token. Its output
    goes to files; every other descriptor (the grader's result pipe among them) is closed first."""
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.closerange(3, MAX_FD)
        os.chdir(scratch)
        sys.path.extend(site_paths)
        sys.argv = ["solution.py"]
        namespace = {"__name__": "solution", "__builtins__": __builtins__}
        exec(compile(program, "solution.py", "exec"), namespace)
        exec(compile(test, "test.py", "exec"), namespace)
        sys.stdout.flush()
        os.write(1, ("\n" + token + "\n").encode())
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def wait_for(pid: int, timeout_s: float) -> int | None:
    """The exit code of child ``pid`` (negative: the signal), or None if it runs past ``timeout_s``."""
    import select

    deadline = time.monotonic() + timeout_s
    try:
        exited = os.pidfd_open(pid)  # readable once the child exited
    except (AttributeError, OSError):  # Linux < 5.3: poll
        exited = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if exited is not None:
                select.select([exited], [], [], remaining)
            else:
                time.sleep(min(0.005, remaining))
    finally:
        if exited is not None:
            os.close(exited)


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
            results.append(
                run_test(
                    payload["program"],
                    test,
                    min(float(payload["timeout_s"]), remaining),
                    scratch,
                    payload.get("site_paths", []),
                )
            )
        finally:
            remove_tree(scratch)
    print(f"\n{payload['nonce']} {json.dumps(results)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
