"""Building the token-level trajectory: ids and logprobs appended exactly as received."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout_service.schemas import TRUNCATING_REASONS, FinishReason, Trajectory, Turn


class TrajectoryBuilder:
    def __init__(self, prompt_ids: list[int], messages: list[dict[str, Any]]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.messages = [dict(m) for m in messages]
        self._unsettled: list[tuple[Turn, Callable[[], int | None]]] = []

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_generation(
        self,
        token_ids: list[int],
        logprobs: list[float],
        *,
        backend_id: str,
        policy_version: int | None,
        finish_reason: str,
        latency_s: float,
        moved_from: str | None = None,
        ended_under: Callable[[], int | None] | None = None,
    ) -> None:
        """``ended_under``: answers the policy version when the call ended (read later, by ``settle``)."""
        if len(token_ids) != len(logprobs):
            from rollout_service.errors import BackendError

            raise BackendError(
                f"backend {backend_id} returned {len(token_ids)} ids but "
                f"{len(logprobs)} logprobs; is logprobs requested and supported?"
            )
        self.settle()
        turn = Turn(
            start=0,
            end=0,
            kind="generation",
            backend_id=backend_id,
            policy_version=policy_version,
            finish_reason=finish_reason,
            latency_s=latency_s,
            moved_from=moved_from,
        )
        self._append(token_ids, logprobs, 1, turn)
        if ended_under is not None:
            self._unsettled.append((turn, ended_under))

    def settle(self) -> None:
        """Record ``resumed_under`` on each generation whose call ended under another policy version
        than it started (a keep-mode pause froze it across a weight sync). Their answers came with
        Redis round trips long gone by the next call or the end of the episode: no wait."""
        for turn, ended_under in self._unsettled:
            version = ended_under()
            if version is not None and turn.policy_version is not None and version != turn.policy_version:
                turn.resumed_under = version
        self._unsettled.clear()

    def add_observation(self, token_ids: list[int], latency_s: float) -> None:
        self._append(
            token_ids, [0.0] * len(token_ids), 0, Turn(start=0, end=0, kind="observation", latency_s=latency_s)
        )

    def _append(self, ids: list[int], logprobs: list[float], mask: int, turn: Turn) -> None:
        turn.start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.loss_mask.extend([mask] * len(ids))
        turn.end = len(self.response_ids)
        self.turns.append(turn)

    def build(self, finish_reason: FinishReason, reward: float | None = None) -> Trajectory:
        self.settle()
        return Trajectory(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            turns=self.turns,
            messages=self.messages,
            reward=reward,
            finish_reason=finish_reason,
            truncated=finish_reason in TRUNCATING_REASONS,
        )
