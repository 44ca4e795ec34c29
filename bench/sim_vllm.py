"""A simulated vLLM server: answers ``POST /v1/completions`` (token ids in, token ids + logprobs
out, vLLM's response shape) after a fixed delay, with a scripted agent that calls a tool on
every turn but the last and then ``finish``.

It stands in for a GPU server that takes ``--delay-s`` per call whatever the load, so a
benchmark measures the rollout service, not the model. One asyncio process, raw HTTP/1.1 with
keep-alive, no framework, orjson: thousands of concurrent calls cost it little CPU (it shares the
machine with the service it measures).

Each answer is sent at the request's arrival plus ``--delay-s``, woken by a thread to within
~0.3 ms; ``GET /lateness`` says how late the answers since the last ask were sent (p50, p99, max
in ms): the part of a call's time beyond the delay that is the simulator's, not the service's.

The turn is the number of assistant turns already in the prompt (count of the
``<|im_start|>assistant`` id pair minus the generation prompt). ``--filler-tokens N`` puts N
ordinary tokens before the tool call (long trajectories).

    python bench/sim_vllm.py --tokenizer DIR --port 8200 --delay-s 1.0 --turns 4 \
        [--tool bash --tool-args '{"command": "echo hi"}'] [--finish-answer '\\boxed{4}']
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import sys
import threading
import time
from array import array
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_service.runtime.tokens import load_tokenizer  # noqa: E402


def tool_call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Script:
    def __init__(
        self, tokenizer_dir: str, turns: int, tool: str, tool_args: dict, finish_answer: str, filler_tokens: int
    ) -> None:
        tok = load_tokenizer(tokenizer_dir)
        end_id = tok.convert_tokens_to_ids("<|im_end|>")
        filler = tok.encode(" a", add_special_tokens=False) * filler_tokens if filler_tokens else []
        step = tok.encode(tool_call_text(tool, tool_args), add_special_tokens=False)
        finish = tok.encode(tool_call_text("finish", {"answer": finish_answer}), add_special_tokens=False)
        self.turns = [filler + step + [end_id]] * (turns - 1) + [filler + finish + [end_id]]
        self.bodies = [self._body(ids) for ids in self.turns]
        marker = tok.encode("<|im_start|>assistant", add_special_tokens=False)[:2]
        self.marker = array("i", marker).tobytes()

    @staticmethod
    def _body(ids: list[int]) -> bytes:
        return json.dumps(
            {
                "id": "cmpl-sim",
                "object": "text_completion",
                "model": "sim",
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "token_ids": ids,
                        "finish_reason": "stop",
                        "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids)},
                    }
                ],
                "usage": {"completion_tokens": len(ids)},
            }
        ).encode()

    def answer(self, prompt_ids: list[int]) -> bytes:
        completed = array("i", prompt_ids).tobytes().count(self.marker) - 1
        return self.bodies[min(max(completed, 0), len(self.bodies) - 1)]


class Alarm:
    """Wakes futures at their deadline to within ~0.3 ms (0.13 ms p50 under load), from one thread.

    An event loop's own timers are late by 0.1 % of the wait (the kernel's slack for epoll
    timeouts: ~1 ms for a 1 s call) plus libuv's millisecond rounding. A GPU server has no such
    wait, so that lateness would count as the service's overhead. A futex wait (a lock's
    timeout) gets the thread's 50 us slack instead."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, asyncio.Future]] = []
        self.ready = threading.Condition()
        self.lateness_s: list[float] = []
        threading.Thread(target=self._run, name="alarm", daemon=True).start()

    def at(self, deadline: float) -> asyncio.Future:
        future = self.loop.create_future()
        with self.ready:
            heapq.heappush(self.heap, (deadline, id(future), future))
            if self.heap[0][2] is future:
                self.ready.notify()
        return future

    def _run(self) -> None:
        while True:
            with self.ready:
                while not self.heap or self.heap[0][0] > (now := time.monotonic()):
                    self.ready.wait(self.heap[0][0] - now if self.heap else None)
                due = []
                while self.heap and self.heap[0][0] <= now:
                    due.append(heapq.heappop(self.heap))
            self.loop.call_soon_threadsafe(self._wake, due)

    def _wake(self, due: list[tuple[float, int, asyncio.Future]]) -> None:
        now = time.monotonic()
        for deadline, _, future in due:
            self.lateness_s.append(now - deadline)
            if not future.done():
                future.set_result(None)


def lateness_ms(alarm: Alarm) -> dict:
    late = sorted(alarm.lateness_s)
    if not late:
        return {}
    pick = lambda q: round(late[min(int(q * len(late)), len(late) - 1)] * 1e3, 3)  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "max": round(late[-1] * 1e3, 3)}


async def serve(script: Script, host: str, port: int, delay_s: float) -> None:
    calls = 0
    alarm = Alarm(asyncio.get_running_loop())

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                length = 0
                for line in header_lines:
                    if line[:15].lower() == "content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                received = time.monotonic()
                method, path, _ = request_line.split(" ", 2)
                if method == "POST" and path == "/v1/completions":
                    calls += 1
                    payload = script.answer(orjson.loads(body)["prompt"])
                    if delay_s > 0:
                        await alarm.at(received + delay_s)
                    status = "200 OK"
                elif path in ("/health", "/calls"):
                    payload, status = json.dumps({"calls": calls}).encode(), "200 OK"
                elif path == "/lateness":  # since the last time asked
                    payload, status = json.dumps(lateness_ms(alarm)).encode(), "200 OK"
                    alarm.lateness_s = []
                else:
                    payload, status = b'{"error": {"message": "not found"}}', "404 Not Found"
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, backlog=4096)
    print(f"sim-vllm listening on http://{host}:{port} (delay {delay_s} s)", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-s", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tool", default="nothing")
    parser.add_argument("--tool-args", default="{}")
    parser.add_argument("--finish-answer", default="\\boxed{4}")
    parser.add_argument("--filler-tokens", type=int, default=0)
    args = parser.parse_args(argv)
    script = Script(
        args.tokenizer, args.turns, args.tool, json.loads(args.tool_args), args.finish_answer, args.filler_tokens
    )
    try:  # libuv's event loop: the simulated server shares the machine with the service it measures
        import uvloop
    except ImportError:
        asyncio.run(serve(script, args.host, args.port, args.delay_s))
    else:
        uvloop.run(serve(script, args.host, args.port, args.delay_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
