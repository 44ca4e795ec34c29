"""What every tool returns: an observation dict, with terminal noise removed and size capped."""

from __future__ import annotations

import re

TYPE_CHECKING = False  # importing typing would slow every sandbox boot; annotations are not evaluated
if TYPE_CHECKING:
    from typing import Any

_ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colors, cursor moves, bracketed paste
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC: window titles, hyperlinks
    r"|\x1b[@-Z\\-_]"  # two-byte escapes
)


def observation(
    output: str = "",
    *,
    exit_code: int | None = None,
    timed_out: bool = False,
    error: str | None = None,
    finished: bool = False,
    answer: str | None = None,
) -> dict[str, Any]:
    return {
        "output": output,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "error": error,
        "finished": finished,
        "answer": answer,
    }


def error_observation(message: str) -> dict[str, Any]:
    return observation(f"ERROR: {message}", error=message)


def clean_terminal_text(text: str) -> str:
    """Strip ANSI escapes and resolve carriage returns the way a terminal would show them."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    if "\r" in text:
        text = "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line else line for line in text.split("\n"))
    return text.replace("\x07", "")


def cap_output(text: str, cap_bytes: int) -> str:
    """Keep the first and last halves of ``cap_bytes`` and say how much was cut in between."""
    data = text.encode("utf-8", "replace")
    if len(data) <= cap_bytes:
        return text
    half = max(cap_bytes // 2, 1)
    head = data[:half].decode("utf-8", "ignore")
    tail = data[-half:].decode("utf-8", "ignore")
    cut = len(data) - len(head.encode()) - len(tail.encode())
    return f"{head}\n[... {cut} bytes of output cut; {len(data)} bytes in total ...]\n{tail}"


class HeadTailBuffer:
    """Bytes from a stream, keeping at most ``keep`` bytes at each end so memory stays bounded."""

    def __init__(self, keep: int) -> None:
        self.keep = max(keep, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.keep - len(self.head)
        if room > 0 and not self.tail:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        excess = len(self.tail) - 2 * self.keep
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        middle = f"\n[... {self.dropped} bytes of output cut ...]\n" if self.dropped else ""
        return self.head.decode("utf-8", "replace") + middle + self.tail.decode("utf-8", "replace")
