"""A simulated vLLM server: answers ``POST /v1/completions`` (token ids in, token ids + logprobs
out, vLLM's response shape) after a fixed delay, with a scripted agent that calls a tool on
every turn but the last and then ``finish``.

It stands in for a GPU server that takes ``--delay-s`` per call whatever the load, so a
benchmark measures the rollout service, not the model. One asyncio process, raw HTTP/1.1 with
keep-alive, no framework, orjson: thousands of concurrent calls cost it little CPU (it shares the
machine with the service it measures).

The turn is the number of assistant turns already in the prompt (count of the
``<|im_start|>assistant`` id pair minus the generation prompt). ``--filler-tokens N`` puts N
ordinary tokens before the tool call (long trajectories).

    python bench/sim_vllm.py --tokenizer DIR --port 8200 --delay-s 1.0 --turns 4 \
        [--tool bash --tool-args '{"command": "echo hi"}'] [--finish-answer '\\boxed{4}']
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from array import array
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_service.tokens import load_tokenizer  # noqa: E402


def tool_call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Script:
    def __init__(self, tokenizer_dir: str, turns: int, tool: str, tool_args: dict, finish_answer: str,
                 filler_tokens: int) -> None:
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
        return json.dumps({
            "id": "cmpl-sim", "object": "text_completion", "model": "sim",
            "choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "stop",
                         "logprobs": {"tokens": [f"token_id:{i}" for i in ids],
                                      "token_logprobs": [-0.5] * len(ids)}}],
            "usage": {"completion_tokens": len(ids)},
        }).encode()

    def answer(self, prompt_ids: list[int]) -> bytes:
        completed = array("i", prompt_ids).tobytes().count(self.marker) - 1
        return self.bodies[min(max(completed, 0), len(self.bodies) - 1)]


async def serve(script: Script, host: str, port: int, delay_s: float) -> None:
    calls = 0

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
                method, path, _ = request_line.split(" ", 2)
                if method == "POST" and path == "/v1/completions":
                    calls += 1
                    payload = script.answer(orjson.loads(body)["prompt"])
                    await asyncio.sleep(delay_s)
                    status = "200 OK"
                elif path in ("/health", "/calls"):
                    payload, status = json.dumps({"calls": calls}).encode(), "200 OK"
                else:
                    payload, status = b'{"error": {"message": "not found"}}', "404 Not Found"
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
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
    script = Script(args.tokenizer, args.turns, args.tool, json.loads(args.tool_args), args.finish_answer,
                    args.filler_tokens)
    try:  # libuv's event loop: the simulated server shares the machine with the service it measures
        import uvloop
    except ImportError:
        asyncio.run(serve(script, args.host, args.port, args.delay_s))
    else:
        uvloop.run(serve(script, args.host, args.port, args.delay_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
