"""External agent harnesses: a job's own OpenAI-compatible ``/v1/chat/completions``, served by
the run worker on a Unix socket bound into the job's sandbox, and the harness run inside it.

Every call goes through the job's ``PooledLLM`` (sticky backend, pause/resume, failover,
policy versions) in token space. A conversation that extends the previous call's prompt +
completion (the previous messages, then the assistant reply exactly as returned, then new
tool/user messages) is appended as an observation delta, like the built-in agent does: the
history is never re-rendered. Any other conversation is rendered whole and starts a new
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
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pydantic

from rollout_service.agent import Episode, EpisodeInterrupted, Limits
from rollout_service.api.common import validation_message
from rollout_service.errors import HarnessFailed, RolloutError
from rollout_service.sandbox.harness_launcher import RESULT_MARKER
from rollout_service.schemas import ChatCompletionRequest, FinishReason, HarnessConfig, Segment, Trajectory, TRUNCATING_REASONS
from rollout_service.tokens import ChatRenderer
from rollout_service.toolcalls import ToolCall, ToolCallParser
from rollout_service.trajectory import TrajectoryBuilder

log = logging.getLogger(__name__)

ENDPOINT_SOCKET = "openai.sock"
STOP_FILE = "harness.stop"
MESSAGES_FILE = "messages.json"
ANSWER_FILE = "answer"  # in the sandbox's own socket directory: one per attempt, removed with it
WATCH_INTERVAL_S = 0.25
LAUNCHER_GRACE_S = 30.0
LAUNCH_BOOTSTRAP = (
    "import sys; sys.path[0] = {path!r}; "
    "from rollout_service.sandbox.harness_launcher import main; main()"
)


class ChatError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "type": self.code}}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ChatError(400, "invalid_request", f"{where}.function.arguments must be a JSON object (or its JSON string)")
    return value


def template_message(message: Any, index: int) -> dict[str, Any]:
    """An OpenAI message in the shape chat templates expect (text content, argument objects)."""
    out: dict[str, Any] = {"role": message.role, "content": _text(message.content)}
    if message.role == "developer":
        out["role"] = "system"
    extra = message.model_extra or {}
    if message.role == "tool" and isinstance(extra.get("name"), str):
        out["name"] = extra["name"]
    if message.tool_calls:
        calls = []
        for k, call in enumerate(message.tool_calls):
            where = f"messages[{index}].tool_calls[{k}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ChatError(400, "invalid_request", f'{where} needs {{"type": "function", "function": {{"name", "arguments"}}}}')
            calls.append(ToolCall(function["name"], _arguments(function.get("arguments", {}), where)).to_openai())
        out["tool_calls"] = calls
    return out


@dataclass
class ChatSession:
    """The LLM side of one harness episode: answers chat.completions calls and records them."""

    llm: Any
    renderer: ChatRenderer
    parser: ToolCallParser
    limits: Limits
    api_key: str
    stop_reason: Callable[[], Optional[FinishReason]] = lambda: None
    segments: list[TrajectoryBuilder] = field(default_factory=list)
    stopped: Optional[FinishReason] = None
    failure: Optional[BaseException] = None
    final_text: str = ""
    calls: int = 0
    _previous: Optional[tuple[list[dict[str, Any]], Any, list[int]]] = None  # messages, tools, generated
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, path: str, authorization: str, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            if path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                raise ChatError(404, "not_found", f"no route {path}; this endpoint serves POST /v1/chat/completions")
            if not secrets.compare_digest(authorization.encode(), f"Bearer {self.api_key}".encode()):
                raise ChatError(401, "unauthorized", "wrong or missing API key: send Authorization: Bearer $OPENAI_API_KEY")
            try:
                request = ChatCompletionRequest.model_validate_json(body or b"null")
            except pydantic.ValidationError as exc:
                raise ChatError(400, "invalid_request", validation_message(exc)) from None
            with self._lock:
                return 200, self.complete(request)
        except ChatError as exc:
            return exc.status, exc.body()
        except Exception as exc:  # a bug: the job fails with it once the harness is stopped
            self.failure = self.failure or exc
            log.exception("openai endpoint failed")
            return 500, ChatError(500, "internal_error", f"{type(exc).__name__}: {exc}").body()

    def complete(self, request: ChatCompletionRequest) -> dict[str, Any]:
        messages = [template_message(m, i) for i, m in enumerate(request.messages)]
        tools = request.tools or None
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
            self.stopped = FinishReason.context_length
            raise self._ended()
        asked = request.max_completion_tokens or request.max_tokens
        prompt_len = record.context_len
        try:
            generated = self.llm.generate(record.context_ids, min(room, asked or room), record)
        except EpisodeInterrupted as stop:
            self.stopped = stop.reason
            raise self._ended() from None
        except RolloutError as exc:  # an infrastructure error: the job fails with it
            self.failure = exc
            raise ChatError(502, exc.code, f"the job's inference failed: {exc.message}") from None
        self.calls += 1
        text = self.renderer.decode_generation(generated)
        parsed = self.parser.parse(text)
        reply: dict[str, Any] = {"role": "assistant", "content": text if parsed.errors else parsed.content}
        if parsed.calls and not parsed.errors:
            reply["tool_calls"] = [call.to_openai() for call in parsed.calls]
        record.messages.append(reply)
        self.final_text = text
        self._previous = ([*messages, reply], tools, generated)
        return self._completion(reply, record.turns[-1].finish_reason, prompt_len, len(generated), request.model)

    def _record_for(self, messages: list[dict[str, Any]], tools: Any) -> TrajectoryBuilder:
        """The segment this call extends (after appending the observation delta), or a new one."""
        if self._previous is not None:
            before, before_tools, generated = self._previous
            new = messages[len(before):]
            if (tools == before_tools and messages[:len(before)] == before and new
                    and all(m["role"] != "assistant" for m in new)):
                record = self.segments[-1]
                started = time.monotonic()
                delta = self.renderer.observation_delta(new, generated)
                if self.limits.max_model_len and record.context_len + len(delta) >= self.limits.max_model_len:
                    self.stopped = FinishReason.context_length
                    raise self._ended()
                record.messages.extend(new)
                record.add_observation(delta, time.monotonic() - started)
                return record
        prompt = self.renderer.encode(self.renderer.render_text(messages, tools, add_generation_prompt=True))
        self.segments.append(TrajectoryBuilder(prompt, messages))
        return self.segments[-1]

    def _ended(self) -> ChatError:
        reason = self.stopped.value if self.stopped else "error"
        return ChatError(409, "episode_over", f"this rollout is over (finish_reason={reason}); exit the harness")

    @staticmethod
    def _completion(reply: dict[str, Any], finish: Optional[str], prompt_len: int, generated: int,
                    model: Optional[str]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if reply.get("tool_calls"):
            message["content"] = reply["content"] or None
            message["tool_calls"] = [
                {"id": f"call_{secrets.token_hex(6)}", "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in reply["tool_calls"]]
        reason = "tool_calls" if reply.get("tool_calls") else ("length" if finish == "length" else "stop")
        return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
                "model": model or "rollout", "choices": [{"index": 0, "message": message, "finish_reason": reason}],
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": generated,
                          "total_tokens": prompt_len + generated}}

    def build(self, finish_reason: FinishReason) -> Trajectory:
        if not self.segments:
            return Trajectory(finish_reason=finish_reason, truncated=finish_reason in TRUNCATING_REASONS)
        first, *later = self.segments
        trajectory = first.build(finish_reason)
        trajectory.segments = [Segment(prompt_ids=s.prompt_ids, response_ids=s.response_ids, loss_mask=s.loss_mask,
                                       logprobs=s.logprobs, turns=s.turns, messages=s.messages) for s in later]
        return trajectory


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "EndpointServer"

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        status, doc = self.server.session.handle(self.path, self.headers.get("Authorization", ""), self.rfile.read(length))
        self._send(status, doc)

    def do_GET(self) -> None:
        self._send(404, ChatError(404, "not_found", "this endpoint serves POST /v1/chat/completions").body())

    def _send(self, status: int, doc: dict[str, Any]) -> None:
        payload = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def address_string(self) -> str:
        return "harness"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("openai endpoint: " + format, *args)


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


def launcher_command(harness: HarnessConfig, inside: tuple[str, str, str], api_key: str, deadline_s: float) -> str:
    python, package_dir, inner_dir = inside
    env = {**harness.env, "OPENAI_API_KEY": api_key, "ROLLOUT_MESSAGES_FILE": f"{inner_dir}/{MESSAGES_FILE}"}
    argv = [python, "-c", LAUNCH_BOOTSTRAP.format(path=package_dir),
            "--socket", f"{inner_dir}/{ENDPOINT_SOCKET}", "--stop-file", f"{inner_dir}/{STOP_FILE}",
            "--answer-file", f"{inner_dir}/{ANSWER_FILE}", "--deadline-s", f"{deadline_s:.3f}", "--env-json", json.dumps(env),
            "--", *harness.command]
    return shlex.join(argv)


def parse_result(output: str) -> Optional[dict[str, Any]]:
    at = output.rfind(RESULT_MARKER + " ")
    if at < 0:
        return None
    try:
        return json.loads(output[at + len(RESULT_MARKER) + 1:].splitlines()[0])
    except (ValueError, IndexError):
        return None


def run_harness(sandbox: Any, session: ChatSession, harness: HarnessConfig, messages: list[dict[str, Any]],
                deadline_at: float, cancelled: Callable[[], bool]) -> Episode:
    """Serve the job's endpoint, run the harness in ``sandbox`` until it exits (or is stopped),
    and return the recorded trajectory and its answer."""
    socket_dir = sandbox.socket_dir
    with open(os.path.join(socket_dir, MESSAGES_FILE), "w") as f:
        json.dump(messages, f)
    os.chmod(os.path.join(socket_dir, MESSAGES_FILE), 0o644)
    server = EndpointServer(os.path.join(socket_dir, ENDPOINT_SOCKET), session)
    remaining_s = max(deadline_at - time.time(), 0.1)
    command = launcher_command(harness, sandbox.inside(), session.api_key, remaining_s)
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
        tail = output[-1500:]
        raise HarnessFailed(f"the harness {harness.command!r} failed "
                            f"(exit code {result.get('exit_code') if result else 'unknown'}); "
                            f"fix the harness or its command; its output ends with: {tail}")
    else:
        reason = FinishReason.finished
    answer = result.get("answer") if result else None
    return Episode(session.build(reason), answer or None, session.final_text)
