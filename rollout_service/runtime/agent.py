"""The multi-turn agent loop: generate → parse → act → observe, in token space.

Three failure channels: a tool error is an observation the model sees; a limit ends the
episode with a finish reason; an infrastructure error raises (the job's status).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_service.runtime.toolcalls import ToolCall
from rollout_service.runtime.trajectory import TrajectoryBuilder
from rollout_service.schemas import FinishReason, Trajectory


class EpisodeInterrupted(Exception):
    """Raised from inside a turn (e.g. while waiting out a weight-sync pause) to end the episode."""

    def __init__(self, reason: FinishReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


@dataclass
class Limits:
    max_turns: int
    max_new_tokens: int
    max_model_len: int | None
    tool_timeout_s: float
    deadline_at: float = math.inf  # time.time() by which the episode must end


@dataclass
class Episode:
    trajectory: Trajectory
    answer: str | None
    final_text: str


class LLM(Protocol):
    def generate(self, prompt_ids: list[int], max_new_tokens: int, record: TrajectoryBuilder) -> list[int]:
        """Generate, append ids/logprobs/call record to ``record``, return the generated ids."""


class Renderer(Protocol):
    def observation_delta(self, messages: list[dict[str, Any]], generated_ids: list[int]) -> list[int]: ...

    def decode_generation(self, ids: list[int]) -> str: ...


class Executor(Protocol):
    def execute(self, tool: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]: ...


@dataclass
class Agent:
    llm: LLM
    renderer: Renderer
    parser: Any
    tools: tuple[str, ...]
    executor: Executor | None
    limits: Limits
    stop_reason: Callable[[], FinishReason | None] = lambda: None
    history: TrajectoryBuilder = field(init=False)

    def run(self, prompt_ids: list[int], messages: list[dict[str, Any]]) -> Episode:
        self.history = TrajectoryBuilder(prompt_ids, messages)
        try:
            return self._loop()
        except EpisodeInterrupted as stop:
            return self._end(stop.reason)

    def _loop(self) -> Episode:
        record = self.history
        text = ""
        for _ in range(self.limits.max_turns):
            if reason := self.stop_reason():
                return self._end(reason, final_text=text)
            room = self._room()
            if room <= 0:
                return self._end(FinishReason.context_length, final_text=text)
            generated = self.llm.generate(record.context_ids, min(self.limits.max_new_tokens, room), record)
            text = self.renderer.decode_generation(generated)
            parsed = self.parser.parse(text)
            record.messages.append({"role": "assistant", "content": text})
            if not parsed.calls and not parsed.errors:
                cut = record.turns[-1].finish_reason == "length"  # max_new_tokens ended it, not the model
                return self._end(FinishReason.length if cut else FinishReason.no_tool_call, final_text=text)
            started = time.monotonic()
            observations = [{"role": "tool", "content": e} for e in parsed.errors]
            for call in parsed.calls:
                if call.name == "finish" and "finish" in self.tools:
                    return self._end(FinishReason.finished, str(call.arguments.get("answer", "")), text)
                observations.append({"role": "tool", "name": call.name, "content": self._act(call)})
            delta = self.renderer.observation_delta(observations, generated)
            if self.limits.max_model_len and record.context_len + len(delta) >= self.limits.max_model_len:
                return self._end(FinishReason.context_length, final_text=text)
            record.messages.extend(observations)
            record.add_observation(delta, time.monotonic() - started)
        return self._end(FinishReason.max_turns, final_text=text)

    def _room(self) -> int:
        if not self.limits.max_model_len:
            return self.limits.max_new_tokens
        return self.limits.max_model_len - self.history.context_len

    def _act(self, call: ToolCall) -> str:
        if call.name not in self.tools or self.executor is None:
            return f"Error: unknown tool {call.name!r}. Available tools: {', '.join(self.tools)}."
        timeout_s = min(self.limits.tool_timeout_s, max(self.limits.deadline_at - time.time(), 0.1))
        # a tool's output already carries what the model must see (errors, exit code, timeout notice)
        return self.executor.execute(call.name, call.arguments, timeout_s)["output"] or "[no output]"

    def _end(self, reason: FinishReason, answer: str | None = None, final_text: str = "") -> Episode:
        return Episode(self.history.build(reason), answer, final_text)
