"""run queue: prepare the job, boot its sandbox, run the agent (or harness), extract the artifact,
record the episode; always tear down. How episodes share a worker (slots, start gaps, the call
gate, the first call sent with the stage's begin, background starts) is workers/episodes.py."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_service.runtime.agent import Agent, Episode, Limits
from rollout_service.runtime.harness import ChatSession, harness_messages, new_api_key, run_harness
from rollout_service.runtime.harness_presets import read_only_dirs
from rollout_service.runtime.llm import PooledLLM
from rollout_service.runtime.preparation import prepare_job
from rollout_service.runtime.scoring import complete_scored
from rollout_service.runtime.tokens import ChatRenderer, renderer_for
from rollout_service.runtime.toolcalls import get_parser
from rollout_service.sandbox import SandboxSpec, create_sandbox, needs_sandbox
from rollout_service.sandbox.base import BackgroundStart
from rollout_service.schemas import FinishReason, JobRequest, JobStatus, Prepared, Sampling
from rollout_service.state.backends import BackendPool
from rollout_service.state.metrics_recording import record_episode
from rollout_service.tasks import DomainHandler, get_handler, quick_score, restore_workspace
from workers import dispatch
from workers.celery_app import app
from workers.episodes import EpisodeRunner, EpisodeStart
from workers.stage import StageContext, run_stage_jobs

runner = EpisodeRunner()


@app.task(name=dispatch.TASK_NAMES["run"])
def run_jobs(job_ids: list[str]) -> None:
    """One episode per job, all at once, as many as this process has free slots for (``EpisodeRunner``)."""

    def episode(job_id: str, start: EpisodeStart) -> None:
        run_stage_jobs([job_id], "run", lambda ctx: run_episode(ctx, start), calls=start.begin_call())

    runner.run(job_ids, episode)


@dataclass
class Job:
    """What the episode of one job runs with."""

    request: JobRequest
    prepared: Prepared
    handler: DomainHandler
    sampling: Sampling
    tools: tuple[str, ...]
    renderer: ChatRenderer


def run_episode(ctx: StageContext, start: EpisodeStart) -> None:
    job = prepare(ctx, start)
    llm = job_llm(ctx, job, start.pool)
    agent = job_agent(ctx, job, llm)
    session = harness_session(ctx, job, agent)
    sandbox: BackgroundStart | None = None
    episode: Episode | None = None
    try:
        llm.first_call = start.take_first_call()
        sandbox = boot(ctx, job, start)
        agent.executor = sandbox
        if session is not None:
            episode = run_job_harness(ctx, job, session, sandbox)
        else:
            episode = agent.run(job.prepared.prompt_ids, job.prepared.messages)
        episode_end = time.time()
        start.ended()
        artifact = job.handler.artifact(job.request.task, episode.answer, episode.final_text, sandbox)
    except BaseException:
        if episode is not None:  # the episode ran and what followed it failed: keep the episode
            ctx.store.put_trajectory(ctx.job_id, episode.trajectory)
        raise
    finally:
        if episode is None and session is not None:
            ctx.store.put_trajectory(ctx.job_id, session.build(FinishReason.error))
        elif episode is None and hasattr(agent, "history"):  # an infrastructure error: keep what we have
            ctx.store.put_trajectory(ctx.job_id, agent.history.build(FinishReason.error))
        if sandbox is not None:
            sandbox.stop_soon()
        ctx.end_call = llm.release_with_end()  # the job's backend, released by the stage's end
    record(ctx, job, episode, episode_end, artifact, sandbox)


def prepare(ctx: StageContext, start: EpisodeStart) -> Job:
    """The job's request and preparation (made here for a job that skipped init), its domain,
    sampling and tools; a redelivered job starts from init's workspace again."""
    request = JobRequest.model_validate(ctx.blob("request"))
    if ctx.blobs.get("prepared") is None:  # the job skipped init (tasks.first_stage): prepare it here
        prepared = prepare_skipped(ctx, request, start)
        ctx.end_fields["init_end"] = ctx.end_fields["run_start"] = time.time()
    else:
        prepared = Prepared.model_validate(ctx.blob("prepared"))
    sampling = request.sampling.model_copy(update={"model": prepared.model})
    if sampling.seed is not None:  # rollouts of a group must not replay one sample
        sampling.seed += ctx.rollout_index
    handler = get_handler(request.task["domain"])
    job = Job(request, prepared, handler, sampling, tuple(prepared.tools), renderer_for(prepared.tokenizer))
    if ctx.attempt > 1:  # an earlier delivery died mid-episode: start from init's workspace again
        restore_workspace(job.handler, request.task, Path(prepared.workspace))
    return job


def prepare_skipped(ctx: StageContext, request: JobRequest, start: EpisodeStart) -> Prepared:
    """What init prepares, for a job that skipped it. The model and its tokenizer come from the
    grant of the job's first call (sent with the stage's begin, answered in the same round trip);
    without one (a harness job, a weight sync, a cancel), from the registered backends."""
    granted = start.granted_backend()
    return prepare_job(ctx, request, [granted] if granted is not None else BackendPool(ctx.store.redis).list())


def job_llm(ctx: StageContext, job: Job, pool: BackendPool) -> PooledLLM:
    """The job's LLM; every call also checks the deadline, and the cancel flag while paused."""

    def stop_while_paused() -> FinishReason | None:
        return FinishReason.cancelled if ctx.store.cancel_requested(ctx.job_id) else stop_reason(ctx)

    return PooledLLM(
        pool,
        ctx.job_id,
        job.sampling,
        job.request.timeouts.llm_call_s or ctx.settings.llm_call_timeout_s,
        stop_while_paused,
        deadline_at=ctx.deadline_at,
        job_key=ctx.store.key(ctx.job_id),
        max_policy_lag=job.request.max_policy_lag,
        outage_wait_s=ctx.settings.backend_outage_wait_s,
    )


def stop_reason(ctx: StageContext) -> FinishReason | None:
    return FinishReason.deadline if ctx.remaining_s() <= 0 else None


def job_agent(ctx: StageContext, job: Job, llm: PooledLLM) -> Agent:
    request, settings = job.request, ctx.settings
    return Agent(
        llm=llm,
        renderer=job.renderer,
        parser=get_parser(request.agent.tool_parser),
        tools=job.tools,
        executor=None,
        limits=Limits(
            max_turns=request.agent.max_turns or settings.max_turns,
            max_new_tokens=job.sampling.max_new_tokens or settings.max_new_tokens,
            max_model_len=job.sampling.max_model_len,
            tool_timeout_s=request.timeouts.tool_s or settings.tool_timeout_s,
            deadline_at=ctx.deadline_at,
        ),
        stop_reason=lambda: stop_reason(ctx),
    )


def harness_session(ctx: StageContext, job: Job, agent: Agent) -> ChatSession | None:
    """For a job an external harness drives: the session behind the job's OpenAI endpoint; the
    sandbox then runs the harness (and the domain's artifact) through bash."""
    if job.request.agent.harness is None:
        return None
    session = ChatSession(agent.llm, job.renderer, agent.parser, agent.limits, new_api_key(), agent.stop_reason)
    ctx.store.set_fields(ctx.job_id, harness_api_key=session.api_key)
    job.tools = ("bash",)
    return session


def boot(ctx: StageContext, job: Job, start: EpisodeStart) -> BackgroundStart | None:
    """The job's sandbox, if its episode needs one, starting in the background."""
    harness, settings = job.request.agent.harness, ctx.settings
    if not needs_sandbox(job.tools, harness):
        return None
    Path(job.prepared.workspace).mkdir(parents=True, exist_ok=True)  # a handler that writes none leaves it to us
    spec = SandboxSpec(
        job_id=ctx.job_id,
        workspace=job.prepared.workspace,
        image=job.prepared.image,
        tools=job.tools,
        memory_mb=settings.sandbox_memory_mb,
        cpu_time_s=settings.sandbox_cpu_time_s,
        max_procs=settings.sandbox_max_procs,
        ttl_s=max(ctx.remaining_s(), 1) + 60,
        read_only=read_only_dirs(harness),
        env=dict(job.prepared.extra.get("env") or {}),
        workdir=job.prepared.extra.get("workdir", ""),
        pin_repo=tuple(job.prepared.extra.get("pin_repo") or ()),
    )
    return start.boot(create_sandbox(settings.sandbox, spec, ctx.store.redis))


def run_job_harness(ctx: StageContext, job: Job, session: ChatSession, sandbox: BackgroundStart | None) -> Episode:
    harness = job.request.agent.harness
    assert harness is not None and sandbox is not None  # a harness job always has its sandbox
    own_system_prompt = job.request.agent.system_prompt is not None or "system_prompt" in job.request.task
    return run_harness(
        sandbox.ready(),
        session,
        harness,
        harness_messages(job.prepared.messages, own_system_prompt),
        ctx.deadline_at,
        lambda: ctx.store.cancel_requested(ctx.job_id),
        model=job.prepared.model,
    )


def record(
    ctx: StageContext,
    job: Job,
    episode: Episode,
    episode_end: float,
    artifact: dict[str, Any],
    sandbox: BackgroundStart | None,
) -> None:
    """The trajectory, timings and status the stage ends with; with ``score_in_run``, the quick
    score too (the job then completes here, with no eval hop)."""
    trajectory, reason = episode.trajectory, episode.trajectory.finish_reason
    assert reason is not None  # a built trajectory says why it ended
    boot_s = sandbox.boot_s if sandbox is not None else None  # an episode may end before its sandbox is up
    record_episode(ctx.store.redis, trajectory, boot_s)
    if sandbox is not None:
        ctx.end_fields.update(sandbox_boot_s=boot_s, sandbox_wait_s=sandbox.waited_s)
    ctx.results["trajectory"] = trajectory.model_dump(mode="json")
    ctx.end_fields.update(
        finish_reason=reason.value,
        backend_id=next((t.backend_id for t in reversed(trajectory.turns) if t.backend_id), None),
    )
    ended = {FinishReason.cancelled: JobStatus.cancelled, FinishReason.deadline: JobStatus.timed_out}
    if reason in ended:
        ctx.finish_as = (ended[reason], dict(ctx.end_fields))
    elif ctx.settings.score_in_run and (scored := quick_score(job.handler, job.request.task, artifact)) is not None:
        ctx.results["trajectory"]["reward"] = scored.reward
        ctx.end_fields["run_end"] = episode_end  # and no eval hop: the job completes with the run's end
        complete_scored(ctx, artifact, scored, **ctx.end_fields, eval_start=episode_end, eval_end=time.time())
    else:
        ctx.results["artifact"] = artifact  # eval reads it (a job that ends here keeps it in its result, if scored)
