"""The wire contract: requests, statuses, job views and the trajectory document.

Shared by the gateway, the workers and the client SDK. Request models forbid unknown
fields so a typo is a 400 that names it rather than a silently ignored option.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class JobStatus(str, Enum):
    queued = "queued"
    initializing = "initializing"
    running = "running"
    evaluating = "evaluating"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    timed_out = "timed_out"


TERMINAL_STATUSES = frozenset(
    {JobStatus.completed, JobStatus.failed, JobStatus.cancelled, JobStatus.timed_out}
)


class FinishReason(str, Enum):
    finished = "finished"
    no_tool_call = "no_tool_call"
    max_turns = "max_turns"
    context_length = "context_length"
    deadline = "deadline"
    stale = "stale"
    cancelled = "cancelled"
    error = "error"


TRUNCATING_REASONS = frozenset(
    {FinishReason.max_turns, FinishReason.context_length, FinishReason.deadline,
     FinishReason.stale, FinishReason.cancelled, FinishReason.error}
)


def _require_domain(task: dict[str, Any]) -> dict[str, Any]:
    domain = task.get("domain")
    if not isinstance(domain, str) or not domain:
        raise ValueError('task needs a "domain" string, e.g. {"domain": "math", ...}')
    return task


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Strict):
    model: Optional[str] = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: Optional[int] = Field(None, gt=0, description="per LLM call")
    max_model_len: Optional[int] = Field(None, gt=0, description="context limit in tokens")
    seed: Optional[int] = None
    stop_token_ids: list[int] = Field(default_factory=list)


class AgentConfig(_Strict):
    max_turns: Optional[int] = Field(None, gt=0)
    tool_parser: str = "hermes"
    tools: Optional[list[str]] = Field(None, description="subset of the domain's tools")
    system_prompt: Optional[str] = None


class Timeouts(_Strict):
    job_s: Optional[float] = Field(None, gt=0)
    llm_call_s: Optional[float] = Field(None, gt=0)
    tool_s: Optional[float] = Field(None, gt=0)
    eval_s: Optional[float] = Field(None, gt=0)


class JobRequest(_Strict):
    task: dict[str, Any]
    sampling: Sampling = Field(default_factory=Sampling)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    n: int = Field(1, ge=1, le=1024)
    max_policy_lag: Optional[int] = Field(None, ge=0)
    metadata: dict[str, Any] = Field(default_factory=dict)

    _task_has_domain = field_validator("task")(_require_domain)


class SubmitResponse(BaseModel):
    job_ids: list[str]
    group_id: str


class ErrorInfo(BaseModel):
    code: str
    message: str


class Timings(BaseModel):
    queued_s: Optional[float] = None
    init_s: Optional[float] = None
    run_s: Optional[float] = None
    eval_s: Optional[float] = None


class JobView(BaseModel):
    job_id: str
    status: JobStatus
    group_id: str
    timings: Timings
    reward: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    error: Optional[ErrorInfo] = None
    result: Optional[dict[str, Any]] = None
    backend_id: Optional[str] = None
    attempts: int = 0
    metadata: dict[str, Any] = Field(default_factory=dict)


class Turn(BaseModel):
    start: int
    end: int
    kind: Literal["generation", "observation"]
    backend_id: Optional[str] = None
    policy_version: Optional[int] = None
    finish_reason: Optional[str] = None
    latency_s: float = 0.0
    moved_from: Optional[str] = Field(None, description="backend that died during this call")


class Trajectory(BaseModel):
    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    reward: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    truncated: bool = False


class BackendSpec(_Strict):
    url: str
    kind: Literal["vllm", "sglang", "reference"]
    model: str
    tokenizer: Optional[str] = None

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


class ResumeRequest(_Strict):
    policy_version: Optional[int] = Field(None, ge=0)


class ScoreRequest(_Strict):
    task: dict[str, Any]
    submission: dict[str, Any]

    _task_has_domain = field_validator("task")(_require_domain)


class ScoreResponse(BaseModel):
    reward: float
    details: dict[str, Any] = Field(default_factory=dict)
