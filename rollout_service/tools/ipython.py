"""An IPython kernel per sandbox, driven in-process with jupyter_client over ipc sockets.

The kernel process is launched with the stdlib (a connection file and a subprocess), so it can
start at boot without importing jupyter_client; the client side is imported on first use.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from queue import Empty
from typing import Any

from rollout_service.tools.output import cap_output, clean_terminal_text, error_observation, observation

READY_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 3.0
DEATH_CHECK_S = 0.5


class IPythonSession:
    def __init__(self, cwd: str, env: dict[str, str], python: str = sys.executable) -> None:
        self.cwd = cwd
        self.python = python
        self._dir = tempfile.mkdtemp(prefix=".rollout-ipy-")
        self.env = dict(
            env,
            IPYTHONDIR=os.path.join(self._dir, "ipython"),
            JUPYTER_RUNTIME_DIR=self._dir,
            JUPYTER_PLATFORM_DIRS="1",
            MPLBACKEND="Agg",
            PYDEVD_DISABLE_FILE_VALIDATION="1",
        )
        self._kernel: subprocess.Popen | None = None
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._kernel.pid if self._kernel is not None else None

    def launch(self) -> None:
        """Start the kernel process (cheap: no jupyter_client import). Idempotent."""
        if self._kernel is not None and self._kernel.poll() is None:
            return
        self._client = None
        connection = {
            "transport": "ipc",
            "ip": os.path.join(self._dir, "k"),
            "shell_port": 1,
            "iopub_port": 2,
            "stdin_port": 3,
            "control_port": 4,
            "hb_port": 5,
            "key": secrets.token_hex(16),
            "signature_scheme": "hmac-sha256",
            "kernel_name": "python3",
        }
        self._connection_file = os.path.join(self._dir, "kernel.json")
        with open(self._connection_file, "w") as f:
            json.dump(connection, f)
        with open(os.path.join(self._dir, "kernel.log"), "ab") as log:
            self._kernel = subprocess.Popen(
                [self.python, "-m", "ipykernel_launcher", "-f", self._connection_file],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )

    def connect(self) -> None:
        """Launch if needed, connect a client and wait until the kernel answers. Idempotent."""
        with self._lock:
            self.launch()
            if self._client is not None:
                return
            from jupyter_client import BlockingKernelClient

            client = BlockingKernelClient(connection_file=self._connection_file)
            client.load_connection_file()
            client.start_channels(hb=False)
            try:
                client.wait_for_ready(timeout=READY_TIMEOUT_S)
            except RuntimeError as exc:
                client.stop_channels()
                raise RuntimeError(f"the IPython kernel did not start: {exc}; see {self._dir}/kernel.log") from exc
            self._client = client
            self._execute("%colors nocolor", 10.0, 1024)

    def run(self, code: str, timeout_s: float, output_cap: int) -> dict[str, Any]:
        if not isinstance(code, str) or not code.strip():
            return error_observation("empty cell: give Python code to run")
        try:
            self.connect()
        except Exception as exc:
            self.close(keep_dir=True)
            return error_observation(f"{exc}")
        return self._execute(code, timeout_s, output_cap)

    def _execute(self, code: str, timeout_s: float, output_cap: int) -> dict[str, Any]:
        client = self._client
        msg_id = client.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
        parts: list[str] = []
        error: str | None = None
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not timed_out:
                timed_out = True
                self._interrupt()
                deadline = time.monotonic() + INTERRUPT_GRACE_S
                continue
            try:
                msg = client.iopub_channel.get_msg(timeout=min(max(remaining, 0.0), DEATH_CHECK_S))
            except Empty:
                if self._kernel is not None and self._kernel.poll() is not None:
                    exit_code = self._kernel.returncode
                    self._restart()
                    notice = (
                        f"[the IPython kernel died (exit code {exit_code}); a new kernel was started and "
                        "all variables were lost]"
                    )
                    return observation(_join(parts, notice, output_cap), error="kernel died")
                if timed_out and time.monotonic() >= deadline:
                    self._restart()
                    notice = (
                        f"[cell timed out after {timeout_s:g} s and did not stop on interrupt; "
                        "the kernel was restarted and all variables were lost]"
                    )
                    return observation(_join(parts, notice, output_cap), timed_out=True, error="timeout")
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                parts.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                data = content.get("data", {})
                if "text/plain" in data:
                    parts.append(data["text/plain"] + "\n")
                else:
                    parts.append(f"[{', '.join(sorted(data))} output]\n")
            elif kind == "error":
                parts.append("\n".join(content.get("traceback") or [f"{content['ename']}: {content['evalue']}"]) + "\n")
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                break
        self._drain_shell(msg_id)
        if timed_out:
            notice = f"[cell timed out after {timeout_s:g} s and was interrupted; variables are kept]"
            return observation(_join(parts, notice, output_cap), timed_out=True, error="timeout")
        return observation(_join(parts, "", output_cap), exit_code=1 if error else 0, error=error)

    def _drain_shell(self, msg_id: str) -> None:
        try:
            while True:
                reply = self._client.shell_channel.get_msg(timeout=1.0)
                if reply["parent_header"].get("msg_id") == msg_id:
                    return
        except Empty:
            return

    def _interrupt(self) -> None:
        if self._kernel is not None:
            try:
                os.kill(self._kernel.pid, signal.SIGINT)
            except OSError:
                pass

    def _restart(self) -> None:
        self.close(keep_dir=True)
        self.launch()

    def close(self, keep_dir: bool = False) -> None:
        if self._client is not None:
            try:
                self._client.stop_channels()
            except Exception:
                pass
            self._client = None
        if self._kernel is not None:
            try:
                os.killpg(self._kernel.pid, signal.SIGKILL)
            except OSError:
                pass
            self._kernel.wait()
            self._kernel = None
        if not keep_dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def _join(parts: list[str], notice: str, output_cap: int) -> str:
    text = cap_output(clean_terminal_text("".join(parts)).rstrip("\n"), output_cap)
    return f"{text}\n{notice}" if text and notice else text or notice
