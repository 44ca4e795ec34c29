"""What a scored job leaves, shared by the stages that score (eval, or run for a quick score)."""

from __future__ import annotations

from typing import Any, Protocol

from rollout_service.schemas import JobStatus, ScoreResponse


class ScoringStage(Protocol):
    """What ``complete_scored`` writes to: the blobs stored and the terminal move made with the stage's end."""

    results: dict[str, Any]
    finish_as: tuple[JobStatus, dict[str, Any]] | None


def complete_scored(stage: ScoringStage, artifact: dict[str, Any], scored: ScoreResponse, **fields: Any) -> None:
    """The job's result and a completed move with the reward and ``fields``."""
    stage.results["result"] = {"artifact": artifact, "details": scored.details}
    stage.finish_as = (JobStatus.completed, {**fields, "reward": scored.reward})
