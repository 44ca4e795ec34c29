"""run queue: boot the sandbox, drive the agent loop, extract the artifact, always tear down."""

from __future__ import annotations

import time
from pathlib import Path

from rollout_service.concurrency.green import after_live_work, green_process, in_background
from rollout_service.runtime.agent import Agent, Episode, Limits
from rollout_service.runtime.harness import ChatSession, harness_messages, new_api_key, run_harness
from rollout_service.runtime.harness_presets import read_only_dirs
from rollout_service.runtime.llm import CALL_GATE, PooledLLM
from rollout_service.runtime.preparation import prepare_job
from rollout_service.runtime.scoring import complete_scored
from rollout_service.runtime.tokens import renderer_for
from rollout_service.runtime.toolcalls import get_parser
from rollout_service.sandbox import SandboxSpec, create_sandbox, needs_sandbox
from rollout_service.sandbox.base import BackgroundStart
from rollout_service.schemas import BackendView, FinishReason, JobRequest, JobStatus, Prepared
from rollout_service.settings import get_settings
from rollout_service.state.backends import AllBackendsDown, BackendPool, FirstCall
from rollout_service.state.metrics_recording import record_episode
from rollout_service.tasks import get_handler, quick_score, restore_workspace
from workers import dispatch
from workers.celery_app import app
from workers.stage import Slots, StageContext, job_store, run_stage_jobs

slots = Slots()
SLOT_WAIT_S = 0.1
END_YIELD_CAP_S = 0.05


@app.task(name=dispatch.TASK_NAMES["run"])
def run_jobs(job_ids: list[str]) -> None:
    """One episode per job, all at once, as many as this process has free slots for; the rest go
    back to the queue for any run worker. (A message can arrive before the prefetch window has
    shrunk for the jobs already running: a full worker gives it back after SLOT_WAIT_S.)"""
    taken = slots.take(len(job_ids), SLOT_WAIT_S)
    if taken < len(job_ids):
        dispatch.send_stage("run", job_ids[taken:])

    def episode(job_id: str, beyond_first: bool) -> None:
        pool = BackendPool(job_store().redis)
        first_call: list[FirstCall] = []  # made by the script that begins the stage
        try:
            run_stage_jobs(
                [job_id],
                "run",
                lambda ctx: run_episode(ctx, pool, first_call),
                calls={job_id: pool.first_call_with_begin(job_id, first_call)},
            )
        finally:
            if first_call:  # the stage began but ended before its episode took it (e.g. past the deadline)
                pool.drop_first_call(job_id, first_call.pop())
            slots.give_back(beyond_first)

    if green_process():
        CALL_GATE.keep(job_store().redis, get_settings().call_gate_lease_s)
    gap_s = get_settings().episode_start_gap_ms / 1000
    joins = []
    for n, job_id in enumerate(job_ids[:taken]):
        if n and gap_s > 0:
            time.sleep(gap_s)  # a green sleep: started together, their calls would answer together every turn
        joins.append(in_background(episode, job_id, n > 0, name=f"run-{job_id}"))
    for join in joins:
        join()


def prepare_skipped(ctx: StageContext, request: JobRequest, first_call: list[FirstCall]) -> Prepared:
    """What init prepares, for a job that skipped it. The model and its tokenizer come from the
    grant of the job's first call (sent with the stage's begin, answered in the same round trip);
    without one (a harness job, a weight sync, a cancel), from the registered backends."""
    try:
        granted = first_call[0]()[0] if first_call else "later"
    except AllBackendsDown:  # the episode's first call waits for one to come back
        granted = "later"
    backends = [granted] if isinstance(granted, BackendView) else BackendPool(ctx.store.redis).list()
    return prepare_job(ctx, request, backends)


def run_episode(ctx: StageContext, pool: BackendPool, first_call: list[FirstCall]) -> None:
    store, job_id, settings = ctx.store, ctx.job_id, ctx.settings
    request = JobRequest.model_validate(ctx.blob("request"))
    if ctx.blobs.get("prepared") is None:  # the job skipped init (tasks.first_stage): prepare it here
        prepared = prepare_skipped(ctx, request, first_call)
        ctx.end_fields["init_end"] = ctx.end_fields["run_start"] = time.time()
    else:
        prepared = Prepared.model_validate(ctx.blob("prepared"))
    handler = get_handler(request.task["domain"])
    sampling = request.sampling.model_copy(update={"model": prepared.model})
    if sampling.seed is not None:  # rollouts of a group must not replay one sample
        sampling.seed += ctx.rollout_index
    tools = tuple(prepared.tools)

    def stop_reason() -> FinishReason | None:  # every LLM call also checks the cancel flag
        return FinishReason.deadline if ctx.remaining_s() <= 0 else None

    def stop_while_paused() -> FinishReason | None:
        return FinishReason.cancelled if store.cancel_requested(job_id) else stop_reason()

    llm = PooledLLM(
        pool,
        job_id,
        sampling,
        request.timeouts.llm_call_s or settings.llm_call_timeout_s,
        stop_while_paused,
        deadline_at=ctx.deadline_at,
        job_key=store.key(job_id),
        max_policy_lag=request.max_policy_lag,
        outage_wait_s=settings.backend_outage_wait_s,
    )
    sandbox = None
    agent = Agent(
        llm=llm,
        renderer=renderer_for(prepared.tokenizer),
        parser=get_parser(request.agent.tool_parser),
        tools=tools,
        executor=None,
        limits=Limits(
            max_turns=request.agent.max_turns or settings.max_turns,
            max_new_tokens=sampling.max_new_tokens or settings.max_new_tokens,
            max_model_len=sampling.max_model_len,
            tool_timeout_s=request.timeouts.tool_s or settings.tool_timeout_s,
            deadline_at=ctx.deadline_at,
        ),
        stop_reason=stop_reason,
    )
    if ctx.attempt > 1:  # an earlier delivery died mid-episode: start from init's workspace again
        restore_workspace(handler, request.task, Path(prepared.workspace))
    harness = request.agent.harness
    session: ChatSession | None = None
    if harness is not None:  # an external harness drives the episode through the job's OpenAI endpoint
        session = ChatSession(llm, agent.renderer, agent.parser, agent.limits, new_api_key(), stop_reason)
        store.set_fields(job_id, harness_api_key=session.api_key)
        tools = ("bash",)  # the sandbox runs the harness (and the domain's artifact) through bash
    episode: Episode | None = None
    try:
        llm.first_call = first_call.pop() if first_call else None  # released with the job's backend if unused
        if needs_sandbox(tools, harness):
            Path(prepared.workspace).mkdir(parents=True, exist_ok=True)  # a handler that writes none leaves it to us
            sandbox = BackgroundStart(
                create_sandbox(
                    settings.sandbox,
                    SandboxSpec(
                        job_id=job_id,
                        workspace=prepared.workspace,
                        image=prepared.image,
                        tools=tools,
                        memory_mb=settings.sandbox_memory_mb,
                        cpu_time_s=settings.sandbox_cpu_time_s,
                        max_procs=settings.sandbox_max_procs,
                        ttl_s=max(ctx.remaining_s(), 1) + 60,
                        read_only=read_only_dirs(harness),
                    ),
                    store.redis,
                )
            )
            agent.executor = sandbox
        if session is not None:
            own_system_prompt = request.agent.system_prompt is not None or "system_prompt" in request.task
            messages = harness_messages(prepared.messages, own_system_prompt)
            episode = run_harness(
                sandbox.ready(),
                session,
                harness,
                messages,
                ctx.deadline_at,
                lambda: store.cancel_requested(job_id),
                model=prepared.model,
            )
        else:
            episode = agent.run(prepared.prompt_ids, prepared.messages)
        episode_end = time.time()
        after_live_work(END_YIELD_CAP_S)  # live turns first: 1,000 episodes end within ~0.5 s
        artifact = handler.artifact(request.task, episode.answer, episode.final_text, sandbox)
    except BaseException:
        if episode is not None:  # the episode ran and what followed it failed: keep the episode
            store.put_trajectory(job_id, episode.trajectory)
        raise
    finally:
        if episode is None and session is not None:
            store.put_trajectory(job_id, session.build(FinishReason.error))
        elif episode is None and hasattr(agent, "history"):  # an infrastructure error: keep what we have
            store.put_trajectory(job_id, agent.history.build(FinishReason.error))
        if sandbox is not None:
            sandbox.stop_soon()
        llm.release()
    trajectory = episode.trajectory
    boot_s = sandbox.boot_s if sandbox is not None else None  # an episode may end before its sandbox is up
    record_episode(store.redis, trajectory, boot_s)
    if sandbox is not None:
        ctx.end_fields.update(sandbox_boot_s=boot_s, sandbox_wait_s=sandbox.waited_s)
    ctx.results["trajectory"] = trajectory.model_dump(mode="json")
    ctx.end_fields.update(
        finish_reason=trajectory.finish_reason.value,
        backend_id=next((t.backend_id for t in reversed(trajectory.turns) if t.backend_id), None),
    )
    ended = {FinishReason.cancelled: JobStatus.cancelled, FinishReason.deadline: JobStatus.timed_out}
    if trajectory.finish_reason in ended:
        ctx.finish_as = (ended[trajectory.finish_reason], dict(ctx.end_fields))
    elif settings.score_in_run and (scored := quick_score(handler, request.task, artifact)) is not None:
        ctx.results["trajectory"]["reward"] = scored.reward
        ctx.end_fields["run_end"] = episode_end  # and no eval hop: the job completes with the run's end
        complete_scored(ctx, artifact, scored, **ctx.end_fields, eval_start=episode_end, eval_end=time.time())
    else:
        ctx.results["artifact"] = artifact  # eval reads it (a job that ends here keeps it in its result, if scored)
