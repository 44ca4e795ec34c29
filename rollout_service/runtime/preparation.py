"""Job preparation, shared by the gateway and the stages: the submission checks (the gateway runs
them before anything is stored, init again before preparing, with the same messages) and
``prepare_job``, which turns a job request into what its episode starts from (``Prepared``)."""

from __future__ import annotations

from typing import Any, Protocol

from rollout_service.errors import NoBackendAvailable, UnknownName, ValidationError
from rollout_service.runtime.harness_presets import check_harness
from rollout_service.runtime.tokens import renderer_for
from rollout_service.runtime.toolcalls import PARSERS
from rollout_service.schemas import (
    AgentConfig,
    BackendView,
    JobRequest,
    Prepared,
    Sampling,
)
from rollout_service.settings import Settings
from rollout_service.state.backends import BackendPool
from rollout_service.state.keys import workspace_dir
from rollout_service.state.store import JobStore
from rollout_service.tasks import DomainHandler, get_handler
from rollout_service.tools.schemas import tool_schemas


class PreparingStage(Protocol):
    """What ``prepare_job`` needs from the stage preparing a job."""

    job_id: str
    store: JobStore
    settings: Settings
    end_fields: dict[str, Any]


def check_job(
    task: dict[str, Any], sampling: Sampling, agent: AgentConfig, models: list[str], where: str = "", task_at: str = ""
) -> None:
    """What the schema cannot see: the task's own fields, the model against the registered
    backends, and the agent's tools and tool parser. Field names in messages start with ``where``
    (``jobs[3]``) and the task's with ``task_at`` (default ``<where>.task``; a batch passes
    ``tasks[0]``). ``models`` empty skips the model check (no backend yet: init says so, unless one
    registers before then)."""
    at = f"{where}." if where else ""
    task_at = task_at or f"{at}task"
    try:
        handler = get_handler(task["domain"])
    except UnknownName as exc:
        raise ValidationError(f"{task_at}.domain: {exc.message}") from None
    try:
        handler.validate(task)
    except ValidationError as exc:
        message = exc.message
        raise ValidationError(
            task_at + message[4:] if message.startswith("task.") else f"{task_at}: {message}"
        ) from None
    if models:
        check_model(sampling.model, models, at)
    if agent.tools is not None:
        check_tools(handler, task, agent.tools, at, f" ({task_at})" if where or task_at != "task" else "")
    if agent.harness is not None:
        check_harness(agent.harness, at)
    if agent.tool_parser not in PARSERS:
        raise ValidationError(
            f"{at}agent.tool_parser {agent.tool_parser!r} is unknown; valid: {', '.join(sorted(PARSERS))}"
        )


def check_model(model: str | None, models: list[str], at: str = "") -> str:
    """The served model a job asking for ``model`` runs on (``models``: those registered, not empty)."""
    if model is None:
        if len(models) > 1:
            raise ValidationError(
                f"{at}sampling.model is required when several models are served; choose one of {models}"
            )
        return models[0]
    if model not in models:
        raise ValidationError(f"{at}sampling.model {model!r} is not served; registered models: {models}")
    return model


def check_tools(
    handler: DomainHandler, task: dict[str, Any], tools: list[str] | tuple[str, ...], at: str = "", task_shown: str = ""
) -> None:
    offered = handler.offered_tools(task)
    unknown = sorted(set(tools) - set(offered))
    if unknown:
        raise ValidationError(
            f"{at}agent.tools {unknown} are not offered by domain {handler.name!r}"
            f"{task_shown}; it offers {list(offered)}"
        )


def resolve_model(backends: list[BackendView], model: str | None) -> tuple[str, str]:
    """The job's model pool and its tokenizer (every backend of a model shares one tokenizer)."""
    models = sorted({b.model for b in backends})
    if not models:
        raise NoBackendAvailable(
            'no inference backend is registered: POST /v1/backends {"url": ..., "kind": "vllm", "model": ...} first'
        )
    model = check_model(model, models)
    return model, next(b.tokenizer for b in backends if b.model == model)


def with_finish_hint(messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """The task's messages for the built-in agent: its last user message ends with how to submit
    with its finish tool (a harness has no such tool, and is not told of it)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if not hint or last is None:
        return messages
    return [{**m, "content": m["content"] + hint} if i == last else m for i, m in enumerate(messages)]


def prepare_job(stage: PreparingStage, request: JobRequest, backends: list[BackendView]) -> Prepared:
    """Checks, handler, workspace and prompt ids; ``backends`` is filled if empty. Init runs it, and
    run for a job that skipped init (``tasks.first_stage``)."""
    check_job(request.task, request.sampling, request.agent, [])
    handler = get_handler(request.task["domain"])
    if not backends:
        backends += BackendPool(stage.store.redis).list()
    model, tokenizer = resolve_model(backends, request.sampling.model)
    workspace = workspace_dir(stage.settings, stage.job_id)  # made by the handlers that fill it, or the sandbox
    setup = handler.prepare(request.task, workspace)
    tools = tuple(request.agent.tools) if request.agent.tools is not None else setup.tools
    check_tools(handler, request.task, tools)
    messages = with_finish_hint(setup.messages, setup.finish_hint) if request.agent.harness is None else setup.messages
    if request.agent.system_prompt is not None:
        messages = [{"role": "system", "content": request.agent.system_prompt}] + [
            m for m in messages if m["role"] != "system"
        ]
    prompt_ids = renderer_for(tokenizer).initial_prompt(messages, tool_schemas(tools))
    if request.agent.harness is None:  # run may send its first call with the stage's begin (a sandbox boots meanwhile)
        stage.end_fields["first_call_model"] = model
    return Prepared.model_construct(  # every field is built here: nothing to validate
        prompt_ids=prompt_ids,
        messages=messages,
        tools=list(tools),
        model=model,
        tokenizer=tokenizer,
        workspace=str(workspace),
        image=setup.image,
        extra=setup.extra,
    )
