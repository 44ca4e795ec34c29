"""``/v1/backends``: register, list and remove inference servers; pause, resume and reload their
weights for weight syncs (the service is the control plane of its engines)."""

from __future__ import annotations

import time
from pathlib import Path

from flask import Blueprint, Response, request

from rollout_service.errors import ValidationError
from rollout_service.gateway.api.common import Query, body, reply, route, seconds_arg, settings, store
from rollout_service.runtime.tokens import tokenizer_problem
from rollout_service.schemas import (
    MAX_PAUSE_TTL_S,
    MAX_WAIT_S,
    BackendList,
    BackendSpec,
    BackendView,
    Deleted,
    PauseState,
    ResumeRequest,
    UpdateWeightsRequest,
    UpdateWeightsResult,
)
from rollout_service.state.backends import PAUSE_MODES, BackendPool, answers_health, control_engines

blueprint = Blueprint("backends", __name__)


def admitted(spec: BackendSpec, probe_timeout_s: float = 2.0) -> bool:
    """Check a backend about to be registered: a tokenizer this host cannot load offline is a
    ValidationError naming it; the answer is whether the server answers its health probe now (a
    server still starting is registered unhealthy, and its jobs wait for it)."""
    tokenizer = spec.tokenizer or spec.model
    if (problem := tokenizer_problem(tokenizer)) is not None:
        defaulted = "" if spec.tokenizer else " (`tokenizer` defaults to `model`)"
        raise ValidationError(f"`tokenizer`{defaulted}: {problem}")
    return answers_health(spec.url, probe_timeout_s)


def pool() -> BackendPool:
    return BackendPool(store().redis)


@route(
    blueprint,
    "post",
    "/v1/backends",
    "Register an inference backend (vLLM, SGLang, reference)",
    request=BackendSpec,
    response=BackendView,
    status=201,
)
def add_backend() -> Response:
    spec = BackendSpec.model_validate(body())
    return reply(pool().register(spec, healthy=admitted(spec)).model_dump(), 201)


@route(
    blueprint, "get", "/v1/backends", "Backends with health and live assignment counts", response=BackendList, errors=()
)
def list_backends() -> Response:
    p = pool()
    return reply(
        {"backends": [b.model_dump() for b in p.list()], "paused": p.paused(), "policy_version": p.policy_version()}
    )


@route(
    blueprint,
    "delete",
    "/v1/backends/{backend_id}",
    "Remove a backend (its jobs move on)",
    response=Deleted,
    errors=(404,),
)
def delete_backend(backend_id: str) -> Response:
    pool().remove(backend_id)
    return reply({"deleted": backend_id})


@route(
    blueprint,
    "post",
    "/v1/backends/pause",
    "Stop new LLM calls and pause every engine for a weight sync",
    response=PauseState,
    query=(
        Query(
            "mode",
            "string",
            "what the engines do with the calls in flight: `wait` (default) lets them "
            "finish under the old weights, `keep` freezes them in the engine until resume "
            "(they end under the new weights), `abort` drops them (each is made again after "
            "resume; its job does not fail); in every mode no new call starts until resume",
            enum=PAUSE_MODES,
        ),
        Query(
            "wait",
            "number",
            f"seconds to wait for running calls to end, at most {MAX_WAIT_S:.0f} "
            "(not in mode keep: its calls end only after resume)",
            minimum=0,
            maximum=MAX_WAIT_S,
        ),
        Query(
            "ttl",
            "number",
            "seconds until the pause lifts by itself unless renewed or resumed "
            f"(default ROLLOUT_PAUSE_TTL_S, 600; at most {MAX_PAUSE_TTL_S:.0f})",
            exclusive_minimum=0,
            maximum=MAX_PAUSE_TTL_S,
        ),
    ),
)
def pause() -> Response:
    mode = request.args.get("mode", "wait")
    if mode not in PAUSE_MODES:
        raise ValidationError(f"`mode` must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
    wait_s = seconds_arg("wait", 0.0, maximum=MAX_WAIT_S)
    ttl_s = seconds_arg("ttl", min(settings().pause_ttl_s, MAX_PAUSE_TTL_S), maximum=MAX_PAUSE_TTL_S, positive=True)
    p = pool()
    p.pause(ttl_s)
    deadline = time.monotonic() + wait_s

    def inflight() -> int:  # a run worker whose call gate is still open may yet start a call: one more
        return p.inflight_calls() + p.open_gates()

    def wait_for_calls() -> None:
        while inflight() and time.monotonic() < deadline and p.paused():
            time.sleep(0.02)

    if mode == "wait":  # drained here first: an engine paused meanwhile would hold a late call, not finish it
        wait_for_calls()
    p.engines_paused(True)
    engines = control_engines(p.list(), "pause", settings().engine_control_timeout_s + wait_s, mode=mode)
    if mode == "abort":
        wait_for_calls()
    expires_in_s = p.pause_expires_in_s()
    return reply(
        {
            "paused": expires_in_s is not None,
            "inflight_calls": inflight(),
            "policy_version": p.policy_version(),
            "expires_in_s": expires_in_s,
            "mode": mode,
            "engines": [e.model_dump() for e in engines],
        }
    )


@route(
    blueprint,
    "post",
    "/v1/backends/resume",
    "Resume every engine and LLM calls under a (new) policy version",
    request=ResumeRequest,
    response=PauseState,
    request_optional=True,
)
def resume() -> Response:
    req = ResumeRequest.model_validate(body(default={}))
    p = pool()
    version = p.resume(req.policy_version, lift=False)  # first, so calls a keep-mode pause froze end under it
    engines = control_engines(p.list(), "resume", settings().engine_control_timeout_s)
    p.engines_paused(False)
    p.resume(version)
    return reply({"paused": False, "policy_version": version, "engines": [e.model_dump() for e in engines]})


@route(
    blueprint,
    "post",
    "/v1/backends/update_weights",
    "Load new weights from disk into every engine of a model; answers once all report done",
    request=UpdateWeightsRequest,
    response=UpdateWeightsResult,
    errors=(400, 502),
)
def update_weights() -> Response:
    req = UpdateWeightsRequest.model_validate(body())
    model_path = checked_model_path(req.model_path)
    p = pool()
    model = req.model or only_model(p.models())
    backends = [b for b in p.list() if b.model == model]
    if not backends:
        raise ValidationError(
            f"`model` {model!r} is served by no backend; served models: {', '.join(p.models()) or 'none'}"
        )
    p.check_version(req.policy_version)
    engines = control_engines(
        backends, "update_weights", settings().weight_update_timeout_s, model_path=str(model_path)
    )
    failed = [e for e in engines if not e.ok]
    if failed:
        version = p.policy_version()
        problems = "; ".join(f"{e.url} ({e.kind}): {e.error}" for e in failed)
        return reply(
            {
                "error": {
                    "code": "backend_error",
                    "message": (
                        f"{len(failed)} of {len(engines)} engines of model {model!r} did not load {model_path}: {problems}. "
                        f"The policy version stays {version}; fix or remove those backends and post again"
                    ),
                },
                "model": model,
                "model_path": str(model_path),
                "policy_version": version,
                "engines": [e.model_dump() for e in engines],
            },
            502,
        )
    version = p.weights_loaded(req.policy_version)
    return reply(
        UpdateWeightsResult(
            model=model, model_path=str(model_path), policy_version=version, engines=engines
        ).model_dump()
    )


def checked_model_path(raw: str) -> Path:
    path = Path(raw)
    if not path.is_absolute():
        raise ValidationError(f"`model_path` {raw!r} must be an absolute path (each engine opens it itself)")
    if not path.is_dir():
        raise ValidationError(
            f"`model_path` {raw!r} is not a directory on the gateway's host; save the weights "
            "with model.save_pretrained(DIR) where the engines can read it and pass DIR"
        )
    if not (path / "config.json").is_file():
        raise ValidationError(
            f"`model_path` {raw!r} has no config.json; pass a directory written by model.save_pretrained(DIR)"
        )
    return path


def only_model(models: list[str]) -> str:
    if not models:
        raise ValidationError("no backend is registered: register one with POST /v1/backends first")
    if len(models) > 1:
        raise ValidationError(f"several models are served ({', '.join(models)}); set `model` to the pool to update")
    return models[0]
