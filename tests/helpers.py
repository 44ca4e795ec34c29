"""Helpers shared by test files: scripted-model replies, tasks, exact-trajectory checks, waiting,
and /proc look-ups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from rollout_service.devtools.engines import VLLMServer


def tool_call(name: str, **arguments: object) -> str:
    """A scripted model's reply that calls tool ``name`` (Qwen/Hermes ``<tool_call>`` format)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def math_task(problem: str, answer: str = "4") -> dict:
    return {"domain": "math", "problem": problem, "answer": answer}


def slow_script(problem: str, turns: int, delay_s: float) -> dict:
    """A reference-server script: ``turns - 1`` ipython calls each generated in ``delay_s``, then a finish."""
    steps = [{"text": tool_call("ipython", code=f"print({i})"), "delay_s": delay_s} for i in range(turns - 1)]
    return {"episodes": [{"match": problem, "turns": steps + [tool_call("finish", answer="\\boxed{4}")]}]}


def server_log(backend_url: str) -> list[dict]:
    """Every generation request a reference server answered, with the ids and logprobs it returned."""
    return httpx.get(f"{backend_url}/debug/requests").json()


def assert_trajectory_is_exactly_what_the_server_returned(trajectory: Any, requests: list[dict]) -> None:
    generations = [t for t in trajectory.turns if t.kind == "generation"]
    assert len(generations) == len(requests)
    for turn, call in zip(generations, requests):
        assert call["prompt_ids"] == trajectory.prompt_ids + trajectory.response_ids[: turn.start]
        assert trajectory.response_ids[turn.start : turn.end] == call["output_ids"]
        assert trajectory.logprobs[turn.start : turn.end] == call["logprobs"]
    n = len(trajectory.response_ids)
    assert len(trajectory.logprobs) == n and len(trajectory.loss_mask) == n
    for turn in trajectory.turns:
        expected_mask = 1 if turn.kind == "generation" else 0
        assert set(trajectory.loss_mask[turn.start : turn.end]) <= {expected_mask}


def wait_for(condition: Callable[[], object], timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def processes_with(environment_entry: str) -> list[int]:
    """Pids whose environment holds ``environment_entry`` (``NAME=value``)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and environment_entry.encode() in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def run_fresh(script: str) -> Any:
    """Run ``script`` in a fresh Python process at the repository's root and return the JSON it
    prints. For code that changes what a test process cannot take back (gevent's monkeypatching,
    the garbage collector's state)."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def run_with_broker(redis_url: str, code: str, **settings_env: str) -> dict:
    """Run ``code`` in a fresh process whose settings come from ``settings_env`` and whose Redis is
    ``redis_url``; return the JSON its last output line prints. For code that changes what a test
    process cannot take back (monkeypatching, resource limits, signal handlers); an in-process test
    takes the ``celery_app`` fixture instead."""
    env = {**os.environ, **settings_env, "ROLLOUT_REDIS_URL": redis_url, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


TOOL_LOOP_HARNESS = r"""
import json, os, subprocess, urllib.request

BASE, KEY = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
TOOLS = [{"type": "function", "function": {"name": "shell", "description": "run a shell command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]

def chat(messages):
    body = json.dumps({"model": "any", "messages": messages, "tools": TOOLS, "temperature": 0.7}).encode()
    request = urllib.request.Request(BASE + "/chat/completions", body, {
        "Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(request, timeout=60))
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] > 0, answer
    return answer["choices"][0]

messages = json.load(open(os.environ["ROLLOUT_MESSAGES_FILE"]))
while True:
    choice = chat(messages)
    message = choice["message"]
    messages.append(message)
    if choice["finish_reason"] != "tool_calls":
        break
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"], call
        command = json.loads(call["function"]["arguments"])["command"]
        output = subprocess.run(command, shell=True, capture_output=True, text=True).stdout
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
assert message["content"] == "The answer is \\boxed{4}.", message
summary = chat([messages[0], {"role": "user", "content": "REWRITE-MARKER: summarize the episode."}])
assert summary["message"]["content"] == "Summary: 4", summary
with open(os.environ["ROLLOUT_ANSWER_FILE"], "w") as f:
    f.write("\\boxed{4}")
"""


def vllm_rescored(engine: VLLMServer, prompt_ids: list[int], generated: list[int], timeout_s: float) -> list[float]:
    """vLLM's own logprob of each generated token, scoring prompt + generation as a prompt
    (``prompt_logprobs``, temperature 1)."""
    answer = httpx.post(
        f"{engine.url}/v1/completions",
        timeout=timeout_s,
        json={
            "model": engine.model,
            "prompt": prompt_ids + generated,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 1.0,
        },
    ).json()
    return [
        entry[str(token)]["logprob"]
        for entry, token in zip(answer["choices"][0]["prompt_logprobs"][len(prompt_ids) :], generated)
    ]
