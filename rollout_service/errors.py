"""All error types of the service, flat. Messages say how to fix the problem.

``http_status`` and ``code`` are what the gateway puts on the wire; workers store
``code`` as a failed job's typed reason.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis


class RolloutError(Exception):
    http_status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class ConfigError(RolloutError):
    code = "config_error"


class ValidationError(RolloutError):
    http_status = 400
    code = "invalid_request"


class UnknownName(ValidationError):
    code = "unknown_name"

    def __init__(self, what: str, name: str, valid: Iterable[str]) -> None:
        super().__init__(f"unknown {what} {name!r}; valid: {', '.join(sorted(valid))}")


class Unauthorized(RolloutError):
    http_status = 401
    code = "unauthorized"


class NotFound(RolloutError):
    http_status = 404
    code = "not_found"


class Conflict(RolloutError):
    http_status = 409
    code = "conflict"


class StoreUnavailable(RolloutError):
    http_status = 503
    code = "store_unavailable"


# The state store away (restarting, failing over, not answering): never a job's failure. A worker
# waits it out, then leaves the job to another delivery; the gateway answers 503.
STORE_OUTAGE: tuple[type[Exception], ...] = (
    StoreUnavailable,
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ReadOnlyError,
)


class BackendError(RolloutError):
    """An inference server could not be reached or answered nonsense."""

    http_status = 502
    code = "backend_error"


class NoBackendAvailable(BackendError):
    code = "no_backend"


class BackendUnreachable(BackendError):
    """Connecting to an inference server failed, retries included (worth failing over)."""

    code = "backend_unreachable"


class GenerationAborted(BackendError):
    """The engine dropped the generation (an abort-mode pause of a weight sync): made again after it."""

    code = "generation_aborted"


class BackendTimeout(BackendError):
    """An inference server accepted the call but did not answer within the call's deadline."""

    code = "backend_timeout"


class BackendRejected(BackendError):
    """An inference server answered a non-2xx status; ``status`` is that status."""

    code = "backend_rejected"

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class ContextWindowExceeded(BackendRejected):
    """The server refused the prompt as longer than its model's context: a limit the episode
    reached (finish reason ``context_length``), not a failure. Set ``sampling.max_model_len`` to
    stop before the server has to say so."""

    code = "context_window_exceeded"


class SandboxError(RolloutError):
    """A sandbox failed to start, answer, or stop (not a tool error: those are observations)."""

    code = "sandbox_error"


class ImageError(SandboxError):
    """An image could not be fetched, verified or unpacked (names the image and what failed)."""

    http_status = 400
    code = "image_error"


class TaskError(RolloutError):
    """A domain handler could not prepare or score a task."""

    code = "task_error"


class RedeliveryLimit(RolloutError):
    code = "redelivery_limit"


class DeadlineExceeded(RolloutError):
    code = "deadline"


class ApiError(RolloutError):
    """The client SDK's view of an error answer from the gateway."""

    def __init__(self, http_status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {http_status} {code}: {message}")
        self.http_status = http_status
        self.code = code


class ScoringTimeout(RolloutError):
    http_status = 504
    code = "score_timeout"


class HarnessFailed(RolloutError):
    """The job's external agent harness (``agent.harness``) exited with an error."""

    code = "harness_failed"


class RequestTooLarge(RolloutError):
    http_status = 413
    code = "request_too_large"


class UnsupportedMediaType(RolloutError):
    http_status = 415
    code = "unsupported_media_type"


class TrainerFormatError(RolloutError, ValueError):
    """Trajectories that a trainer format cannot hold as they are (nothing is dropped silently)."""

    code = "trainer_format"
