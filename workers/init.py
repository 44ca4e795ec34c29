"""init queue: everything expensive before the episode — handler, workspace, prompt ids."""
from __future__ import annotations

from rollout_service.backends import BackendPool
from rollout_service.errors import NoBackendAvailable, ValidationError
from rollout_service.schemas import BackendView, JobRequest, Prepared
from rollout_service.store import workspace_dir
from rollout_service.tasks import get_handler
from rollout_service.tokens import renderer_for
from rollout_service.tools.schemas import tool_schemas
from workers import dispatch
from workers.celery_app import app
from workers.stage import StageContext, run_stage_jobs


@app.task(name=dispatch.TASK_NAMES["init"])
def init_jobs(job_ids: list[str]) -> None:
    """The batch's jobs one after the other with no Redis round trip of their own (the stage reads
    and writes for all of them at once), so concurrent batches finish in turn instead of together."""
    backends: list[BackendView] = []  # read once per batch
    def prepare(ctx: StageContext) -> None:
        request = JobRequest.model_validate(ctx.blob("request"))
        ctx.results["prepared"] = prepare_job(ctx, request, backends).model_dump(mode="json")
    run_stage_jobs(job_ids, "init", prepare)


def prepare_job(ctx: StageContext, request: JobRequest, backends: list[BackendView]) -> Prepared:
    """Handler, workspace and prompt ids; ``backends`` is filled if empty. Init runs it, and run
    for a job that skipped init (``tasks.first_stage``)."""
    handler = get_handler(request.task["domain"])
    if not backends:
        backends += BackendPool(ctx.store.redis).list()
    model, tokenizer = resolve_model(backends, request.sampling.model)
    workspace = workspace_dir(ctx.settings, ctx.job_id)  # made by the handlers that fill it, or the sandbox
    prepared = handler.prepare(request.task, workspace)
    tools = tuple(request.agent.tools) if request.agent.tools is not None else prepared.tools
    offered = handler.offered_tools(request.task)
    unknown = set(tools) - set(offered)
    if unknown:  # the gateway checks this at submission; this is the second line of defence
        raise ValidationError(f"agent.tools {sorted(unknown)} are not offered by domain "
                              f"{handler.name!r}; it offers {list(offered)}")
    messages = prepared.messages
    if request.agent.system_prompt is not None:
        messages = [{"role": "system", "content": request.agent.system_prompt}] + \
            [m for m in messages if m["role"] != "system"]
    prompt_ids = renderer_for(tokenizer).initial_prompt(messages, tool_schemas(tools))
    if request.agent.harness is None:  # run may send its first call with the stage's begin (a sandbox boots meanwhile)
        ctx.end_fields["first_call_model"] = model
    return Prepared.model_construct(  # every field made here: validating 1,000 prompts' ids took ~1 % of a start wave
        prompt_ids=prompt_ids, messages=messages, tools=list(tools), model=model, tokenizer=tokenizer,
        workspace=str(workspace), image=prepared.image, extra=prepared.extra,
    )


def resolve_model(backends: list[BackendView], model: str | None) -> tuple[str, str]:
    """The job's model pool and its tokenizer (every backend of a model shares one tokenizer)."""
    models = sorted({b.model for b in backends})
    if not models:
        raise NoBackendAvailable("no inference backend is registered: POST /v1/backends "
                                 '{"url": ..., "kind": "vllm", "model": ...} first')
    if model is None:
        if len(models) > 1:
            raise ValidationError(f"sampling.model is required when several models are served; "
                                  f"choose one of {models}")
        model = models[0]
    if model not in models:
        raise ValidationError(f"sampling.model {model!r} is not served; registered models: {models}")
    return model, next(b.tokenizer for b in backends if b.model == model)
