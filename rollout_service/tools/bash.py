"""A persistent bash over a pty: one shell per sandbox, state (cwd, env, functions) kept across calls.

Each call writes the command to a file and types one line, ``__rs_seq=N; . FILE </dev/null``.
``PROMPT_COMMAND`` prints a sentinel carrying a per-shell nonce, the sequence number and ``$?``
when the shell is back at its prompt; the output is everything before it. Reads block in
``select`` (no sleep polling). A timeout sends Ctrl-C, then kills the foreground process group,
then, as a last resort, replaces the shell.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import termios
import time

import ptyprocess

from rollout_service.tools.output import (
    HeadTailBuffer,
    cap_output,
    clean_terminal_text,
    error_observation,
    observation,
)

TYPE_CHECKING = False  # the sandbox's tools do not import typing at run time
if TYPE_CHECKING:
    from typing import Any

INTERRUPT_GRACE_S = 1.0
KILL_GRACE_S = 1.0
START_TIMEOUT_S = 10.0
_SCAN_BACK = 128


class ShellDied(Exception):
    pass


class BashSession:
    def __init__(self, cwd: str, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.env = dict(env, TERM="dumb", PAGER="cat", GIT_PAGER="cat", MANPAGER="cat")
        self.env.pop("PROMPT_COMMAND", None)
        self._dir = os.path.join(os.environ.get("TMPDIR") or "/tmp", f".rollout-bash-{os.urandom(8).hex()}")
        os.mkdir(self._dir, 0o700)
        self._script = os.path.join(self._dir, "command.sh")
        self._process: ptyprocess.PtyProcess | None = None
        self._seq = 0
        self._pending = bytearray()
        self.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        self._nonce = os.urandom(6).hex()
        self._sentinel = re.compile(rb"\x1e\x1e" + self._nonce.encode() + rb" (\d+) (\d+)\x1e\x1e")
        self._process, configured = self._spawn_shell(["bash", "--norc", "--noprofile", "--noediting", "-i"])
        prompt_command = f'__rs_rc=$?; printf "\\036\\036{self._nonce} %s %s\\036\\036" "${{__rs_seq:-0}}" "$__rs_rc"'
        setup = (
            "PS1=''; PS2=''; PS0=''; unset HISTFILE MAILCHECK; set +H; "
            f"{'' if configured else 'stty -echo -onlcr 2>/dev/null; '}"
            f"PROMPT_COMMAND='{prompt_command}'; __rs_seq=0\n"
        )
        self._pending.clear()
        os.write(self._process.fd, setup.encode())
        found = self._read_until_sentinel(0, time.monotonic() + START_TIMEOUT_S, HeadTailBuffer(4096))
        if found is None:
            raise ShellDied("bash did not show its prompt within 10 s")

    def _spawn_shell(self, argv: list[str]) -> tuple[ptyprocess.PtyProcess, bool]:
        """The shell on a new pty, and whether its terminal is set up already (no echo, no CR before
        LF). Spawned with posix_spawn (vfork): forking this server to exec bash would copy its page
        tables and pages at every sandbox; ptyprocess's own spawn where the shell must
        start in another directory than this one."""
        if os.path.realpath(os.getcwd()) != os.path.realpath(self.cwd):
            return ptyprocess.PtyProcess.spawn(
                argv, cwd=self.cwd, env=self.env, echo=False, dimensions=(40, 200)
            ), False
        master, terminal = os.openpty()
        try:
            attributes = termios.tcgetattr(terminal)
            attributes[1] &= ~termios.ONLCR
            attributes[3] &= ~termios.ECHO
            termios.tcsetattr(terminal, termios.TCSANOW, attributes)
            fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
            pid = os.posix_spawnp(
                argv[0],
                argv,
                self.env,
                setsid=True,
                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.ttyname(terminal), os.O_RDWR, 0),
                    (os.POSIX_SPAWN_DUP2, 0, 1),
                    (os.POSIX_SPAWN_DUP2, 0, 2),
                ],
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(terminal)
        return ptyprocess.PtyProcess(pid, master), True

    def run(self, command: str, timeout_s: float, output_cap: int) -> dict[str, Any]:
        if not command.strip():
            return error_observation("empty command: give a shell command to run")
        if "\n" in command.strip():
            syntax_error = self._syntax_error(command)
            if syntax_error:
                return observation(
                    f"{syntax_error}\n[bash syntax error: nothing was run; fix the quoting/brackets]",
                    exit_code=2,
                    error="syntax error",
                )
        try:
            return self._run(command, timeout_s, output_cap)
        except ShellDied as exc:
            self._restart()
            return observation(
                f"{exc}\n[the shell exited; a fresh shell was started in {self.cwd}: "
                "environment variables and the working directory were reset]",
                error="shell exited",
            )

    def _run(self, command: str, timeout_s: float, output_cap: int) -> dict[str, Any]:
        assert self._process is not None
        with open(self._script, "w") as f:
            f.write(command if command.endswith("\n") else command + "\n")
        self._seq += 1
        seq = self._seq
        self._drain()
        self._pending.clear()
        os.write(self._process.fd, f"__rs_seq={seq}; . {self._script} </dev/null\n".encode())
        buffer = HeadTailBuffer(output_cap)
        found = self._read_until_sentinel(seq, time.monotonic() + timeout_s, buffer)
        if found is not None:
            text = cap_output(clean_terminal_text(buffer.text()).rstrip("\n"), output_cap)
            if found != 0:
                text = f"{text}\n[exit code {found}]" if text else f"[exit code {found}]"
            return observation(text, exit_code=found)
        how = self._interrupt(seq, buffer)
        text = cap_output(clean_terminal_text(buffer.text()).rstrip("\n"), output_cap)
        notice = f"[command timed out after {timeout_s:g} s and was {how}; the shell is still usable]"
        return observation(f"{text}\n{notice}" if text else notice, timed_out=True, error="timeout")

    def _interrupt(self, seq: int, buffer: HeadTailBuffer) -> str:
        assert self._process is not None
        try:
            os.write(self._process.fd, b"\x03")
            if self._read_until_sentinel(seq, time.monotonic() + INTERRUPT_GRACE_S, buffer) is not None:
                return "interrupted with Ctrl-C"
            foreground = os.tcgetpgrp(self._process.fd)
            if foreground not in (-1, self._process.pid):
                os.killpg(foreground, signal.SIGKILL)
                if self._read_until_sentinel(seq, time.monotonic() + KILL_GRACE_S, buffer) is not None:
                    return "killed"
        except (OSError, ShellDied):
            pass
        self._restart()
        return "killed; the shell had to be restarted, so its state (cwd, variables) was reset"

    def _read_until_sentinel(self, seq: int, deadline: float, buffer: HeadTailBuffer) -> int | None:
        """Read until the sentinel for ``seq`` (returns its exit code) or the deadline (None)."""
        assert self._process is not None
        fd = self._process.fd
        pending = self._pending
        scan_from = 0
        while True:
            match = self._sentinel.search(pending, max(0, scan_from - _SCAN_BACK))
            while match is not None:
                found_seq, exit_code = int(match.group(1)), int(match.group(2))
                buffer.add(bytes(pending[: match.start()]))
                del pending[: match.end()]
                if found_seq == seq:
                    return exit_code
                match = self._sentinel.search(pending)
            if len(pending) > 2 * _SCAN_BACK:
                buffer.add(bytes(pending[:-_SCAN_BACK]))
                del pending[:-_SCAN_BACK]
            scan_from = len(pending)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                buffer.add(bytes(pending))
                pending.clear()
                raise ShellDied(self._exit_note())
            pending += chunk

    def _drain(self) -> None:
        """Discard what background jobs printed between calls."""
        assert self._process is not None
        while select.select([self._process.fd], [], [], 0)[0]:
            try:
                if not os.read(self._process.fd, 65536):
                    return
            except OSError:
                return

    def _exit_note(self) -> str:
        assert self._process is not None
        try:
            self._process.wait()
        except Exception:
            pass
        code = self._process.exitstatus
        return f"bash exited with code {code}" if code is not None else "bash was killed"

    def _syntax_error(self, command: str) -> str | None:
        import subprocess  # only multi-line commands are checked; not paid at every sandbox boot

        check = subprocess.run(
            ["bash", "-n"], input=command, capture_output=True, text=True, cwd=self.cwd, env=self.env
        )
        if check.returncode == 0:
            return None
        return check.stderr.replace("bash: ", "", 1).strip() or "syntax error"

    def _restart(self) -> None:
        self._kill()
        self.start()

    def _kill(self) -> None:
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self._process.close(force=True)
        except Exception:
            pass
        self._process = None

    def close(self) -> None:
        self._kill()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)
