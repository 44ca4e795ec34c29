"""Task domains: one handler per ``task["domain"]``; adding a domain is one module here.

A handler validates a task at submission, prepares it in init (chat messages, tools,
workspace), extracts the artifact after the run, and scores it in eval.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollout_service.errors import UnknownName, ValidationError
from rollout_service.schemas import JobRequest, ScoreResponse
from rollout_service.settings import Settings


@dataclass
class TaskSetup:
    """A handler's part of preparing a job (``preparation.prepare_job`` renders it into ``schemas.Prepared``)."""

    messages: list[dict[str, Any]]
    tools: tuple[str, ...]
    image: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    finish_hint: str = ""  # how to submit with the built-in agent's finish tool: ends its user message, not a harness's


class DomainHandler(Protocol):
    name: str
    prepares_cheaply: bool  # prepare is pure or writes a file or two: the run stage does it (no init hop); a handler may decide per task with ``prepares_cheaply_for(task)``

    def validate(self, task: dict[str, Any]) -> None: ...

    def offered_tools(self, task: dict[str, Any]) -> tuple[str, ...]: ...

    def prepare(self, task: dict[str, Any], workspace: Path) -> TaskSetup: ...

    def artifact(self, task: dict[str, Any], answer: str | None, final_text: str, execute: Any) -> dict[str, Any]: ...

    def score(self, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse: ...


def require(task: dict[str, Any], name: str, kind: type | tuple[type, ...], domain: str) -> Any:
    value = task.get(name)
    if value is None:
        raise ValidationError(f"task.{name} is required for domain {domain!r}")
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValidationError(f"task.{name} must be a {expected}, got {type(value).__name__}")
    return value


def restore_workspace(handler: DomainHandler, task: dict[str, Any], workspace: Path) -> None:
    """Put ``workspace`` back as init prepared it (a redelivered run must not inherit edits)."""
    shutil.rmtree(workspace, ignore_errors=True)
    workspace.mkdir(parents=True)
    handler.prepare(task, workspace)


def _handlers() -> dict[str, DomainHandler]:
    from rollout_service.tasks.code import CodeHandler
    from rollout_service.tasks.math import MathHandler
    from rollout_service.tasks.stem import StemHandler
    from rollout_service.tasks.swe import SweHandler

    return {h.name: h for h in (MathHandler(), StemHandler(), CodeHandler(), SweHandler())}


HANDLERS: dict[str, DomainHandler] = _handlers()


def first_stage(request: JobRequest, settings: Settings) -> str:
    """The queue a job starts on: ``run`` when its domain prepares cheaply (the run worker prepares
    it before the episode, sparing a Celery hop and a Redis round trip), else ``init``."""
    handler = get_handler(request.task["domain"])
    per_task = getattr(handler, "prepares_cheaply_for", None)
    cheap = per_task(request.task) if per_task is not None else getattr(handler, "prepares_cheaply", False)
    return "run" if cheap and settings.init_in_run else "init"


def quick_score(handler: DomainHandler, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse | None:
    """The handler's optional ``quick_score(task, submission)``: the score when it is cheap and certain
    (no parser that might hang, no sandbox), which a run worker gives at the episode's end; None
    (or a handler without one) leaves it to the eval stage."""
    scorer = getattr(handler, "quick_score", None)
    return scorer(task, submission) if scorer is not None else None


def grading_wait_s(task: dict[str, Any], settings: Settings) -> float:
    """How long ``POST /v1/score`` waits for the task's grading: its domain's limit
    (``grading_limit_s(task)``, default eval_timeout_s) and 30 s for the sandbox around it."""
    limit = getattr(get_handler(task["domain"]), "grading_limit_s", None)
    return (limit(task) if limit is not None else settings.eval_timeout_s) + 30


def get_handler(domain: str) -> DomainHandler:
    try:
        return HANDLERS[domain]
    except KeyError:
        raise UnknownName("domain", domain, HANDLERS) from None
