"""``/v1/backends``: register, list and remove inference servers; pause and resume for weight syncs."""
from __future__ import annotations

import time

from flask import Blueprint, Response

from rollout_service.api.common import Query, body, reply, route, seconds_arg, settings, store
from rollout_service.backends import BackendPool, admitted
from rollout_service.schemas import (
    MAX_PAUSE_TTL_S, MAX_WAIT_S, BackendList, BackendSpec, BackendView, Deleted, PauseState, ResumeRequest,
)

blueprint = Blueprint("backends", __name__)


def pool() -> BackendPool:
    return BackendPool(store().redis)


@route(blueprint, "post", "/v1/backends", "Register an inference backend (vLLM, SGLang, reference)",
       request=BackendSpec, response=BackendView, status=201)
def add_backend() -> Response:
    spec = BackendSpec.model_validate(body())
    return reply(pool().register(spec, healthy=admitted(spec)).model_dump(), 201)


@route(blueprint, "get", "/v1/backends", "Backends with health and live assignment counts",
       response=BackendList, errors=())
def list_backends() -> Response:
    p = pool()
    return reply({"backends": [b.model_dump() for b in p.list()],
                  "paused": p.paused(), "policy_version": p.policy_version()})


@route(blueprint, "delete", "/v1/backends/{backend_id}", "Remove a backend (its jobs move on)",
       response=Deleted, errors=(404,))
def delete_backend(backend_id: str) -> Response:
    pool().remove(backend_id)
    return reply({"deleted": backend_id})


@route(blueprint, "post", "/v1/backends/pause", "Stop new LLM calls for a weight sync",
       response=PauseState, query=(
           Query("wait", "number", f"seconds to wait for running calls to end, at most {MAX_WAIT_S:.0f}",
                 minimum=0, maximum=MAX_WAIT_S),
           Query("ttl", "number", "seconds until the pause lifts by itself unless renewed or resumed "
                                  f"(default ROLLOUT_PAUSE_TTL_S, 600; at most {MAX_PAUSE_TTL_S:.0f})",
                 exclusive_minimum=0, maximum=MAX_PAUSE_TTL_S),
       ))
def pause() -> Response:
    wait_s = seconds_arg("wait", 0.0, maximum=MAX_WAIT_S)
    ttl_s = seconds_arg("ttl", min(settings().pause_ttl_s, MAX_PAUSE_TTL_S), maximum=MAX_PAUSE_TTL_S,
                        positive=True)
    p = pool()
    p.pause(ttl_s)
    deadline = time.monotonic() + wait_s

    def inflight() -> int:  # a run worker whose call gate is still open may yet start a call: one more
        return p.inflight_calls() + p.open_gates()
    while inflight() and time.monotonic() < deadline and p.paused():
        time.sleep(0.02)
    expires_in_s = p.pause_expires_in_s()
    return reply({"paused": expires_in_s is not None, "inflight_calls": inflight(),
                  "policy_version": p.policy_version(), "expires_in_s": expires_in_s})


@route(blueprint, "post", "/v1/backends/resume", "Resume LLM calls under a (new) policy version",
       request=ResumeRequest, response=PauseState, request_optional=True)
def resume() -> Response:
    req = ResumeRequest.model_validate(body(default={}))
    version = pool().resume(req.policy_version)
    return reply({"paused": False, "policy_version": version})
