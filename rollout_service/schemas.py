"""The wire contract: requests, statuses, job views and the trajectory document.

Shared by the gateway, the workers and the client SDK. Request models forbid unknown
fields so a typo is a 400 that names it rather than a silently ignored option.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError


class JobStatus(str, Enum):
    queued = "queued"
    initializing = "initializing"
    running = "running"
    evaluating = "evaluating"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    timed_out = "timed_out"


TERMINAL_STATUSES = frozenset({JobStatus.completed, JobStatus.failed, JobStatus.cancelled, JobStatus.timed_out})


class FinishReason(str, Enum):
    finished = "finished"
    no_tool_call = "no_tool_call"
    length = "length"  # the last generation hit max_new_tokens before a tool call or finish
    max_turns = "max_turns"
    context_length = "context_length"
    deadline = "deadline"
    stale = "stale"
    cancelled = "cancelled"
    error = "error"


TRUNCATING_REASONS = frozenset(
    {
        FinishReason.length,
        FinishReason.max_turns,
        FinishReason.context_length,
        FinishReason.deadline,
        FinishReason.stale,
        FinishReason.cancelled,
        FinishReason.error,
    }
)


def _require_domain(task: dict[str, Any]) -> dict[str, Any]:
    domain = task.get("domain")
    if not isinstance(domain, str) or not domain:
        raise ValueError('task needs a "domain" string, e.g. {"domain": "math", ...}')
    return task


TASK_SCHEMA: JsonDict = {
    "required": ["domain"],
    "additionalProperties": True,
    "properties": {"domain": {"type": "string", "minLength": 1, "description": "math | stem | code | swe"}},
    "description": "the domain's fields (checked by its handler: a missing or mistyped one is a 400); other "
    "fields, such as a dataset row's extra columns, are kept with the job and ignored",
}


class _Strict(BaseModel):
    """A request: unknown fields refused, and JSON types as they are (no "10" for 10, no false for 0)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps a bias to [-100, 100]
_SAMPLING_BOUNDS: dict[str, tuple[float, float, bool, str]] = {  # low, high, low excluded, as written
    "min_p": (0.0, 1.0, False, "[0, 1]"),
    "presence_penalty": (-2.0, 2.0, False, "[-2, 2]"),
    "frequency_penalty": (-2.0, 2.0, False, "[-2, 2]"),
    "repetition_penalty": (0.0, 2.0, True, "(0, 2]"),
}


class Sampling(_Strict):
    """What every LLM call of the job samples with: the parameters vLLM and SGLang share, each
    forwarded unchanged (SGLang's names: ``min_new_tokens``, ``sampling_seed``), with their bounds."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, description="in [0, 1]: drop tokens less likely than min_p x the likeliest")
    presence_penalty: float = Field(0.0, description="in [-2, 2]")
    frequency_penalty: float = Field(0.0, description="in [-2, 2]")
    repetition_penalty: float = Field(1.0, description="in (0, 2]; 1 is none")
    max_new_tokens: int | None = Field(None, gt=0, description="per LLM call")
    min_tokens: int = Field(
        0,
        ge=0,
        description="per LLM call: no eos or stop token before this many (capped by what the call may generate)",
    )
    ignore_eos: bool = False
    logit_bias: dict[str, float] = Field(
        default_factory=dict,
        description=(f"token id -> bias added to its logit, in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"),
    )
    max_model_len: int | None = Field(None, gt=0, description="context limit in tokens")
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)

    @field_validator(*_SAMPLING_BOUNDS)
    @classmethod
    def _within_bounds(cls, value: float, info: ValidationInfo) -> float:
        if info.field_name is None:
            raise TypeError("_within_bounds validates fields of Sampling only")
        low, high, low_excluded, written = _SAMPLING_BOUNDS[info.field_name]
        if not (low < value if low_excluded else low <= value) or value > high:
            raise PydanticCustomError(
                "sampling_bound", "must be in {bound}, got {value}", {"bound": written, "value": f"{value:g}"}
            )
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        biases = {}
        for key, bias in value.items():
            if type(key) is int and key >= 0:
                biases[str(key)] = bias
            elif isinstance(key, str) and key.isascii() and key.isdigit():
                biases[str(int(key))] = bias
            else:
                raise PydanticCustomError(
                    "token_id", "keys must be token ids (integers >= 0), got {key}", {"key": repr(key)}
                )
        return biases

    @field_validator("logit_bias")
    @classmethod
    def _bias_bounds(cls, value: dict[str, float]) -> dict[str, float]:
        for key, bias in value.items():
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise PydanticCustomError(
                    "sampling_bound",
                    "the bias of token {key} must be in [-{limit}, {limit}], got {bias}",
                    {"key": key, "limit": f"{LOGIT_BIAS_LIMIT:g}", "bias": f"{bias:g}"},
                )
        return value


class HarnessConfig(_Strict):
    """An external agent harness run inside the job's sandbox against the job's own endpoints
    (OpenAI Chat Completions and Responses, Anthropic Messages; ``OPENAI_BASE_URL``,
    ``ANTHROPIC_BASE_URL`` and their keys in its environment). See docs/harnesses.md."""

    command: list[str] | None = Field(
        None,
        min_length=1,
        description=("argv, run in /workspace inside the sandbox; with a preset, replaces the preset's command"),
    )
    preset: str | None = Field(None, description="a known harness run non-interactively, e.g. 'mini-swe-agent'")
    env_dir: str | None = Field(
        None,
        description=(
            "absolute path of a prepared virtualenv or directory (`rollout-service harness install`), under "
            "ROLLOUT_HARNESS_ROOTS or state_dir/harnesses; bound read-only into the sandbox, its bin/ first on PATH"
        ),
    )
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("command")
    @classmethod
    def _no_empty_arguments(cls, command: list[str] | None) -> list[str] | None:
        if command is not None and not command[0].strip():
            raise ValueError('the program (command[0]) must be a non-empty string, e.g. ["python", "agent.py"]')
        return command

    @model_validator(mode="after")
    def _command_or_preset(self) -> HarnessConfig:
        if self.command is None and self.preset is None:
            raise ValueError(
                'give agent.harness.command (an argv list, e.g. ["python", "agent.py"]) '
                'or agent.harness.preset (e.g. "mini-swe-agent")'
            )
        return self


class AgentConfig(_Strict):
    max_turns: int | None = Field(None, gt=0)
    tool_parser: str = "hermes"
    tools: list[str] | None = Field(None, description="subset of the domain's tools")
    system_prompt: str | None = None
    harness: HarnessConfig | None = Field(None, description="run this program instead of the built-in agent loop")


MIN_TIMEOUT_S = 0.001


class Timeouts(_Strict):
    job_s: float | None = Field(None, ge=MIN_TIMEOUT_S)
    llm_call_s: float | None = Field(None, ge=MIN_TIMEOUT_S)
    tool_s: float | None = Field(None, ge=MIN_TIMEOUT_S)


class JobRequest(_Strict):
    task: dict[str, Any] = Field(json_schema_extra=TASK_SCHEMA)
    sampling: Sampling = Field(default_factory=Sampling)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    n: int = Field(1, ge=1, le=1024)
    max_policy_lag: int | None = Field(None, ge=0)
    metadata: dict[str, Any] = Field(default_factory=dict)

    _task_has_domain = field_validator("task")(_require_domain)


class SubmitResponse(BaseModel):
    job_ids: list[str]
    group_id: str


MAX_BULK_JOBS = 4096
MAX_WAIT_JOBS = 10000
MAX_WAIT_S = 60.0
MAX_PAUSE_TTL_S = 86400.0
MAX_LIST_JOBS = 1000


class BulkJobRequest(_Strict):
    """``POST /v1/jobs/bulk``: many job requests in one round trip, answered in order."""

    jobs: list[JobRequest] = Field(min_length=1, max_length=MAX_BULK_JOBS)


class BulkSubmitResponse(BaseModel):
    submissions: list[SubmitResponse]


class WaitRequest(_Strict):
    """``POST /v1/jobs/wait``: long-poll until ``min_finished`` of ``job_ids`` are terminal."""

    job_ids: list[str] = Field(min_length=1, max_length=MAX_WAIT_JOBS)
    timeout_s: float = Field(10.0, ge=0.0, le=MAX_WAIT_S)
    min_finished: int = Field(1, ge=1, description="capped at len(job_ids)")


class JobIdsRequest(_Strict):
    """``POST /v1/jobs/trajectories``."""

    job_ids: list[str] = Field(min_length=1, max_length=MAX_BULK_JOBS)


class ErrorInfo(BaseModel):
    code: str
    message: str


class Timings(BaseModel):
    queued_s: float | None = Field(None, description="all time spent waiting in queues (sum of waits_s)")
    waits_s: dict[str, float] = Field(default_factory=dict, description="queue wait before each stage")
    init_s: float | None = None
    run_s: float | None = None
    eval_s: float | None = None
    sandbox_boot_s: float | None = Field(None, description="booting the sandbox (while the first LLM call runs)")
    sandbox_wait_s: float | None = Field(None, description="part of run_s: the episode waiting for its sandbox")


class JobView(BaseModel):
    job_id: str
    status: JobStatus
    group_id: str
    timings: Timings
    reward: float | None = None
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    result: dict[str, Any] | None = None
    backend_id: str | None = None
    attempts: int = 0
    metadata: dict[str, Any] = Field(default_factory=dict)


class WaitResponse(BaseModel):
    finished: list[JobView]
    pending: list[str]


class JobList(BaseModel):
    jobs: list[JobView]
    cursor: str | None = Field(None, description="pass as ?cursor= for the next (older) page; null at the end")


class Prepared(BaseModel):
    """What init hands to run (the ``prepared`` blob): the rendered prompt and the sandbox set-up."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[str]
    model: str
    tokenizer: str
    workspace: str
    image: str | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class Turn(BaseModel):
    start: int
    end: int
    kind: Literal["generation", "observation"]
    backend_id: str | None = None
    policy_version: int | None = None
    finish_reason: str | None = None
    latency_s: float = 0.0
    moved_from: str | None = Field(None, description="backend that died during this call")
    resumed_under: int | None = Field(
        None,
        description=(
            "the policy version when this call ended, if it differs from policy_version: a keep-mode pause "
            "froze the call in the engine and it resumed under new weights (tokens before the sync came "
            "from policy_version, the rest from this one)"
        ),
    )


class Segment(BaseModel):
    """A stretch of LLM calls whose prompts extend each other, with the same invariant as the
    trajectory's top level (an external harness that rewrites its history starts a new one)."""

    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)


class Trajectory(Segment):
    """The first segment's ids, logprobs, mask, turns and messages at the top level, then the outcome."""

    reward: float | None = None
    finish_reason: FinishReason | None = None
    truncated: bool = False
    segments: list[Segment] = Field(
        default_factory=list,
        description="later segments (harness mode): calls whose conversation did not "
        "extend the previous call's prompt + completion; the top-level fields are the first segment",
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None


STREAM_DESCRIPTION = "true: the answer as server-sent events, sent once the whole generation is made"


class ChatCompletionRequest(BaseModel):
    """The OpenAI chat.completions request a harness sends (unknown OpenAI options are ignored).
    The job's own ``sampling`` is what generates: the trainer, not the harness, owns the policy's
    sampling, so ``temperature``, ``top_p``, ``seed`` and ``stop`` are accepted and not applied;
    ``max_tokens``/``max_completion_tokens`` only lower the job's per-call cap."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per call")
    stream: bool = Field(False, description=STREAM_DESCRIPTION)


class ResponsesRequest(BaseModel):
    """The OpenAI Responses request a harness sends (``POST /v1/responses``); like chat.completions,
    the job's ``sampling`` generates and ``max_output_tokens`` only lowers the per-call cap."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(
        description="a user message, or message / function_call / function_call_output items"
    )
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = Field(None, gt=0)
    previous_response_id: str | None = None
    stream: bool = Field(False, description=STREAM_DESCRIPTION)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]  # Claude Code puts a system entry in messages for a non-Claude model
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """The Anthropic Messages request a harness sends (``POST /v1/messages``)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int = Field(gt=0, description="lowers the job's per-call cap")
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = Field(False, description=STREAM_DESCRIPTION)


class TrajectoriesResponse(BaseModel):
    trajectories: dict[str, Trajectory | None] = Field(description="null: no trajectory (yet)")


class BackendSpec(_Strict):
    url: str
    kind: Literal["vllm", "sglang", "reference"]
    model: str
    tokenizer: str | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        return url.rstrip("/")


class BackendView(BaseModel):
    id: str
    url: str
    kind: str
    model: str
    tokenizer: str
    healthy: bool
    live_assignments: int
    total_assignments: int
    policy_version: int


class BackendList(BaseModel):
    backends: list[BackendView]
    paused: bool
    policy_version: int


class PauseState(BaseModel):
    paused: bool
    policy_version: int
    inflight_calls: int | None = Field(
        None,
        description="LLM calls still running, plus run workers that may still start one without asking (their call gate closes within ROLLOUT_CALL_GATE_LEASE_S of the pause); 0: safe to sync weights (pause only)",
    )
    expires_in_s: float | None = Field(None, description="seconds until the pause lifts by itself (pause only)")
    mode: str | None = Field(None, description="the pause mode the engines were asked for (pause only)")
    engines: list[EngineResult] | None = Field(None, description="what each registered engine answered")


class Deleted(BaseModel):
    deleted: str


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    ready: bool
    redis: bool
    queues: dict[str, bool] = Field(default_factory=dict)
    reason: str | None = None


class ResumeRequest(_Strict):
    policy_version: int | None = Field(None, ge=0)


class ScoreRequest(_Strict):
    task: dict[str, Any] = Field(json_schema_extra=TASK_SCHEMA)
    submission: dict[str, Any]

    _task_has_domain = field_validator("task")(_require_domain)


class ScoreResponse(BaseModel):
    reward: float
    details: dict[str, Any] = Field(default_factory=dict)


# --------------------------------------------------------------------------- batches


class BatchFilter(str, Enum):
    none = "none"
    nonuniform_reward = "nonuniform_reward"


class OnFailure(str, Enum):
    drop_group = "drop_group"
    retry_rollout = "retry_rollout"


class BatchStatus(str, Enum):
    running = "running"
    completed = "completed"
    cancelled = "cancelled"
    failed = "failed"


class BatchRequest(_Strict):
    """``POST /v1/batches``: K accepted GRPO groups of ``group_size`` rollouts, DAPO-filtered."""

    tasks: list[dict[str, Any]] = Field(
        min_length=1, json_schema_extra={"items": {"type": "object", "additionalProperties": True, **TASK_SCHEMA}}
    )
    group_size: int = Field(ge=1, le=1024)
    target_groups: int = Field(ge=1)
    max_inflight_groups: int | None = Field(None, ge=1, description="default: target_groups")
    filter: BatchFilter = Field(BatchFilter.none, strict=False)  # strict would take only Enum members
    on_failure: OnFailure = Field(OnFailure.drop_group, strict=False)
    max_rollout_retries: int = Field(2, ge=0, le=10, description="per rollout, with retry_rollout")
    sampling: Sampling = Field(default_factory=Sampling)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    max_policy_lag: int | None = Field(None, ge=0)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("tasks")
    @classmethod
    def _every_task_has_a_domain(cls, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, task in enumerate(tasks):
            try:
                _require_domain(task)
            except ValueError as exc:
                raise ValueError(f"tasks[{i}]: {exc}") from None
        return tasks


class BatchCreated(BaseModel):
    batch_id: str


class BatchView(BaseModel):
    batch_id: str
    status: BatchStatus
    reason: str | None = Field(None, description="target_reached | tasks_exhausted | cancelled")
    target_groups: int
    group_size: int
    accepted: int
    dropped: int
    dropped_uniform: int
    dropped_failed: int
    in_flight: int
    cancelled_groups: int
    retried_rollouts: int
    tasks_total: int
    tasks_started: int
    remaining_tasks: list[dict[str, Any]] = Field(
        default_factory=list, description="never started, or started in a group cancelled at completion"
    )
    remaining_task_indices: list[int] = Field(default_factory=list)
    created_at: float
    finished_at: float | None = None


class GroupRollout(BaseModel):
    job_id: str
    status: JobStatus
    reward: float | None = None
    finish_reason: FinishReason | None = None
    trajectory: Trajectory | None = Field(None, description="filled in by the client SDK")


class BatchGroup(BaseModel):
    group_id: str
    task_index: int
    task: dict[str, Any]
    rollouts: list[GroupRollout]
    reward_mean: float
    reward_std: float = Field(description="sample standard deviation (ddof=1), as torch.std")

    @property
    def rewards(self) -> list[float]:
        return [r.reward or 0.0 for r in self.rollouts]

    def advantages(self, eps: float = 1e-6) -> list[float]:
        """GRPO advantages: each reward minus the group mean, over the group std."""
        return [(r - self.reward_mean) / (self.reward_std + eps) for r in self.rewards]


class BatchGroupsPage(BaseModel):
    groups: list[BatchGroup]
    cursor: str
    status: BatchStatus
    done: bool = Field(description="the batch is over and every accepted group has been returned")
    accepted: int = 0
    dropped: int = 0
    in_flight: int = 0


class EngineResult(BaseModel):
    """One engine's answer to a control request of the service (pause, resume, update_weights)."""

    backend_id: str
    url: str
    kind: str
    ok: bool
    error: str | None = Field(None, description="why it failed (unreachable, HTTP status and body, no answer in time)")
    seconds: float = 0.0


class UpdateWeightsRequest(_Strict):
    model_path: str = Field(
        min_length=1,
        description="a directory of weights (config.json + *.safetensors) that every engine of the model can read",
    )
    model: str | None = Field(None, description="the pool to update; default: the only model served")
    policy_version: int | None = Field(None, ge=0, description="the version of these weights; default: current + 1")


class UpdateWeightsResult(BaseModel):
    model: str
    model_path: str
    policy_version: int = Field(description="the policy version now (unchanged if an engine failed)")
    engines: list[EngineResult]


PauseState.model_rebuild()


def where(path: Iterable[Any], prefix: str = "") -> str:
    """``jobs[3].sampling.temperature``; long paths keep their first parts."""
    text = prefix
    for count, part in enumerate(path):
        if count == 12:
            return text + "..."
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


def validation_message(exc: pydantic.ValidationError, prefix: str = "") -> str:
    """``jobs[3].sampling.temperature: Input should be ...`` for every problem pydantic found."""
    return "; ".join(f"{where(e['loc'], prefix)}: {e['msg']}" for e in exc.errors())
