"""External agent harnesses: a job's own model endpoint, served by the run worker on a Unix socket
bound into the job's sandbox, and the harness run inside it.

The endpoint speaks OpenAI Chat Completions, OpenAI Responses and Anthropic Messages
(``rollout_service.runtime.harness_protocols``). Every call goes through the job's ``PooledLLM`` (sticky
backend, pause/resume, failover, policy versions) in token space. A conversation that extends the
previous call's prompt + completion (the previous messages, then the assistant reply exactly as
returned, then new tool/user messages) is appended as an observation delta, like the built-in agent
does: the history is never re-rendered. Any other conversation is rendered whole and starts a new
trajectory segment, so each segment keeps the invariant ``prompt sent == prompt_ids +
response_ids[:start]``.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import secrets
import shlex
import socketserver
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_service.errors import HarnessFailed, RolloutError
from rollout_service.runtime.agent import Episode, EpisodeInterrupted, Limits
from rollout_service.runtime.harness_presets import env_dir_inside, launch
from rollout_service.runtime.harness_protocols import (
    ROUTES,
    ChatError,
    Generated,
    all_routes,
    protocol_for,
    server_sent,
    template_message,
)
from rollout_service.runtime.tokens import ChatRenderer
from rollout_service.runtime.toolcalls import ToolCallParser
from rollout_service.runtime.trajectory import TrajectoryBuilder
from rollout_service.sandbox.harness_launcher import RESULT_MARKER
from rollout_service.schemas import TRUNCATING_REASONS, FinishReason, HarnessConfig, Segment, Trajectory

log = logging.getLogger(__name__)

__all__ = [
    "ChatError",
    "ChatSession",
    "EndpointServer",
    "harness_messages",
    "launcher_command",
    "new_api_key",
    "parse_result",
    "run_harness",
    "template_message",
]

ENDPOINT_SOCKET = "openai.sock"
STOP_FILE = "harness.stop"
MESSAGES_FILE = "messages.json"
ANSWER_FILE = "answer"  # in the sandbox's own socket directory: one per attempt, removed with it
WATCH_INTERVAL_S = 0.25
LAUNCHER_GRACE_S = 30.0
JSON = {"Content-Type": "application/json"}
NO_RETRY = {"x-should-retry": "false"}  # the OpenAI and Anthropic SDKs retry 409s and 5xx without it
LAUNCH_BOOTSTRAP = (
    "import sys; sys.path[0] = {path!r}; from rollout_service.sandbox.harness_launcher import main; main()"
)


@dataclass
class ChatSession:
    """The LLM side of one harness episode: answers the harness's calls and records them."""

    llm: Any
    renderer: ChatRenderer
    parser: ToolCallParser
    limits: Limits
    api_key: str
    stop_reason: Callable[[], FinishReason | None] = lambda: None
    segments: list[TrajectoryBuilder] = field(default_factory=list)
    stopped: FinishReason | None = None
    failure: BaseException | None = None
    final_text: str = ""
    calls: int = 0
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # Responses API: id -> conversation
    _previous: tuple[list[dict[str, Any]], Any, list[int]] | None = None  # messages, tools, generated
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, bytes, dict[str, str]]:
        """(status, body, headers) of one HTTP call: JSON, or server-sent events for ``stream: true``."""
        protocol = protocol_for(path)
        try:
            if protocol is None:
                raise ChatError(404, "not_found", f"no route {path}; this endpoint serves {all_routes()}")
            offered = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")
            if not secrets.compare_digest(offered.encode(), self.api_key.encode()):
                raise ChatError(
                    401,
                    "unauthorized",
                    "wrong or missing API key: send Authorization: Bearer "
                    "$OPENAI_API_KEY (or x-api-key: $ANTHROPIC_API_KEY)",
                )
            with self._lock:
                call = protocol.parse(body, self.responses)
                generated = self.generate(call.messages, call.tools, call.max_tokens)
                answer = protocol.answer(call, generated, self.responses)
            if call.stream:
                return 200, server_sent(protocol.events(answer)), {"Content-Type": "text/event-stream"}
            return 200, json.dumps(answer).encode(), JSON
        except ChatError as exc:
            error = exc
        except Exception as exc:  # a bug: the job fails with it once the harness is stopped
            self.failure = self.failure or exc
            log.exception("harness endpoint failed")
            error = ChatError(500, "internal_error", f"{type(exc).__name__}: {exc}")
        doc = (protocol or ROUTES["/v1/chat/completions"]).error(error)
        return error.status, json.dumps(doc).encode(), {**JSON, **NO_RETRY}

    def generate(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, asked: int | None
    ) -> Generated:
        """One policy call for ``messages`` (chat-template form), recorded in the episode's segments."""
        if self.stopped is not None or self.failure is not None:
            raise self._ended()
        if reason := self.stop_reason():
            self.stopped = reason
            raise self._ended()
        if self.calls >= self.limits.max_turns:
            self.stopped = FinishReason.max_turns
            raise self._ended()
        record = self._record_for(messages, tools)
        room = self.limits.max_new_tokens
        if self.limits.max_model_len:
            room = min(room, self.limits.max_model_len - record.context_len)
        if room <= 0:
            raise self._too_long(record.context_len)
        prompt_len = record.context_len
        try:
            generated = self.llm.generate(record.context_ids, min(room, asked or room), record)
        except EpisodeInterrupted as stop:
            self.stopped = stop.reason
            if stop.reason == FinishReason.context_length:
                raise self._too_long(prompt_len, from_engine=True) from None
            raise self._ended() from None
        except RolloutError as exc:  # an infrastructure error: the job fails with it
            self.failure = exc
            raise ChatError(502, exc.code, f"the job's inference failed: {exc.message}") from None
        self.calls += 1
        text = self.renderer.decode_generation(generated)
        parsed = self.parser.parse(text)
        calls = parsed.calls if parsed.calls and not parsed.errors else []
        reply: dict[str, Any] = {"role": "assistant", "content": text if parsed.errors else parsed.content}
        if calls:
            reply["tool_calls"] = [call.to_openai() for call in calls]
        record.messages.append(reply)
        self.final_text = text
        self._previous = ([*messages, reply], tools, generated)
        finish = "tool_calls" if calls else ("length" if record.turns[-1].finish_reason == "length" else "stop")
        return Generated(reply, calls, finish, prompt_len, len(generated))

    def _record_for(self, messages: list[dict[str, Any]], tools: Any) -> TrajectoryBuilder:
        """The segment this call extends (after appending the observation delta), or a new one."""
        if self._previous is not None:
            before, before_tools, generated = self._previous
            new = messages[len(before) :]
            if (
                tools == before_tools
                and messages[: len(before)] == before
                and new
                and all(m["role"] != "assistant" for m in new)
            ):
                record = self.segments[-1]
                started = time.monotonic()
                delta = self.renderer.observation_delta(new, generated)
                if self.limits.max_model_len and record.context_len + len(delta) >= self.limits.max_model_len:
                    raise self._too_long(record.context_len + len(delta))
                record.messages.extend(new)
                record.add_observation(delta, time.monotonic() - started)
                return record
        prompt = self.renderer.encode(self.renderer.render_text(messages, tools, add_generation_prompt=True))
        if self.limits.max_model_len and len(prompt) >= self.limits.max_model_len:
            raise self._too_long(len(prompt))
        self.segments.append(TrajectoryBuilder(prompt, messages))
        return self.segments[-1]

    def _too_long(self, used: int, from_engine: bool = False) -> ChatError:
        """The episode ends at the context limit; the harness is told in its SDK's words."""
        self.stopped = FinishReason.context_length
        if from_engine:
            return ChatError(
                400,
                "context_length_exceeded",
                "the inference engine refused the prompt as longer than its model's context; this rollout is over",
            )
        return ChatError(
            400,
            "context_length_exceeded",
            "This rollout is over (the job's sampling.max_model_len).",
            limit=self.limits.max_model_len,
            used=used,
        )

    def _ended(self) -> ChatError:
        reason = self.stopped.value if self.stopped else "error"
        return ChatError(409, "episode_over", f"this rollout is over (finish_reason={reason}); exit the harness")

    def build(self, finish_reason: FinishReason) -> Trajectory:
        if not self.segments:
            return Trajectory(finish_reason=finish_reason, truncated=finish_reason in TRUNCATING_REASONS)
        first, *later = self.segments
        trajectory = first.build(finish_reason)
        trajectory.segments = [
            Segment(
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                loss_mask=s.loss_mask,
                logprobs=s.logprobs,
                turns=s.turns,
                messages=s.messages,
            )
            for s in later
        ]
        return trajectory


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: EndpointServer

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        headers = {key.lower(): value for key, value in self.headers.items()}
        self._send(*self.server.session.handle(self.path, headers, self.rfile.read(length)))

    def do_GET(self) -> None:
        doc = {
            "error": {
                "message": f"this endpoint serves {all_routes()}",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        }
        self._send(404, json.dumps(doc).encode(), {**JSON, **NO_RETRY})

    def _send(self, status: int, payload: bytes, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)

    def address_string(self) -> str:
        return "harness"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("harness endpoint: " + format, *args)


class EndpointServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, session: ChatSession) -> None:
        self.session = session
        super().__init__(path, _Handler)
        os.chmod(path, 0o666)  # the sandbox's own uid connects; the directory is private to it
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def new_api_key() -> str:
    return "rk-" + secrets.token_urlsafe(24)


def task_text(messages: list[dict[str, Any]]) -> str:
    """What a preset's agent is asked: the task's user messages."""
    return "\n\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user").strip()


def harness_messages(messages: list[dict[str, Any]], system_prompt_given: bool) -> list[dict[str, Any]]:
    """The task's messages for a harness: the domain's built-in system prompt (instructions for the
    built-in agent's tools) is left out unless the job gave its own."""
    return messages if system_prompt_given else [m for m in messages if m.get("role") != "system"]


def launcher_command(
    harness: HarnessConfig,
    inside: tuple[str, str, str],
    api_key: str,
    deadline_s: float,
    task: str = "",
    model: str = "rollout",
) -> str:
    python, package_dir, inner_dir = inside
    run = launch(harness, task, model, inner_dir)
    env = {**run.env, "OPENAI_API_KEY": api_key, "ROLLOUT_MESSAGES_FILE": f"{inner_dir}/{MESSAGES_FILE}"}
    argv = [
        python,
        "-c",
        LAUNCH_BOOTSTRAP.format(path=package_dir),
        "--socket",
        f"{inner_dir}/{ENDPOINT_SOCKET}",
        "--stop-file",
        f"{inner_dir}/{STOP_FILE}",
        "--answer-file",
        f"{inner_dir}/{ANSWER_FILE}",
        "--deadline-s",
        f"{deadline_s:.3f}",
        "--env-json",
        json.dumps(env),
        "--answer-json",
        json.dumps(run.answer_json),
        "--env-dir",
        env_dir_inside(harness) or "",
        "--",
        *run.command,
    ]
    return shlex.join(argv)


def parse_result(output: str) -> dict[str, Any] | None:
    at = output.rfind(RESULT_MARKER + " ")
    if at < 0:
        return None
    try:
        return json.loads(output[at + len(RESULT_MARKER) + 1 :].splitlines()[0])
    except (ValueError, IndexError):
        return None


def failure_message(harness: HarnessConfig, output: str, result: dict[str, Any] | None) -> str:
    """Why the harness failed, once: the launcher's error, or the exit code and the output's tail."""
    program = harness.command[0] if harness.command else f"of preset {harness.preset!r}"
    if result is not None and result.get("error"):
        return f"the harness failed: {result['error']}"
    tail = output[: output.rfind(RESULT_MARKER)] if result is not None else output
    code = result.get("exit_code") if result else "unknown"
    return (
        f"the harness program {program} exited with code {code}; fix the harness or its command; "
        f"its output ends with: {tail.strip()[-1500:]}"
    )


def run_harness(
    sandbox: Any,
    session: ChatSession,
    harness: HarnessConfig,
    messages: list[dict[str, Any]],
    deadline_at: float,
    cancelled: Callable[[], bool],
    model: str = "rollout",
) -> Episode:
    """Serve the job's endpoint, run the harness in ``sandbox`` until it exits (or is stopped),
    and return the recorded trajectory and its answer."""
    socket_dir = sandbox.socket_dir
    with open(os.path.join(socket_dir, MESSAGES_FILE), "w") as f:
        json.dump(messages, f)
    os.chmod(os.path.join(socket_dir, MESSAGES_FILE), 0o644)
    server = EndpointServer(os.path.join(socket_dir, ENDPOINT_SOCKET), session)
    remaining_s = max(deadline_at - time.time(), 0.1)
    command = launcher_command(harness, sandbox.inside(), session.api_key, remaining_s, task_text(messages), model)
    done: dict[str, Any] = {}

    def execute() -> None:
        try:
            done["result"] = sandbox.execute("bash", {"command": command}, remaining_s + LAUNCHER_GRACE_S)
        except BaseException as exc:
            done["error"] = exc

    runner = threading.Thread(target=execute, daemon=True)
    runner.start()
    stop_written = False
    try:
        while runner.is_alive():
            runner.join(WATCH_INTERVAL_S)
            if stop_written or not runner.is_alive():
                continue
            if cancelled():
                session.stopped = session.stopped or FinishReason.cancelled
            if session.stopped is not None or session.failure is not None:
                stop_path = os.path.join(socket_dir, STOP_FILE)
                with open(stop_path, "w"):
                    pass
                os.chmod(stop_path, 0o644)
                stop_written = True
    finally:
        server.close()
    if "error" in done:
        raise done["error"]
    if session.failure is not None:
        raise session.failure
    output = done["result"].get("output") or ""
    result = parse_result(output)
    if session.stopped is not None:
        reason = session.stopped
    elif result is not None and result.get("stopped") == "deadline":
        reason = FinishReason.deadline
    elif result is None or result.get("exit_code") != 0:
        raise HarnessFailed(failure_message(harness, output, result))
    else:
        reason = FinishReason.finished
    answer = result.get("answer") if result else None
    return Episode(session.build(reason), answer or None, session.final_text)
