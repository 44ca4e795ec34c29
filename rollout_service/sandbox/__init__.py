"""Sandboxes: where the agent's tool calls run. Small interface: start, execute, stop.

    sandbox = create_sandbox(get_settings().sandbox, SandboxSpec(job_id, workspace), redis_client)
    try:
        sandbox.start()
        observation = sandbox.execute("bash", {"command": "ls"}, timeout_s=30)
    finally:
        sandbox.stop()

Kinds: ``bwrap`` (bubblewrap), ``singularity`` (also Apptainer), ``local`` (no isolation).
Inside each, ``rollout_service.tools.action_server`` answers on a Unix socket.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rollout_service.errors import UnknownName
from rollout_service.sandbox.base import Sandbox, SandboxSpec
from rollout_service.sandbox.bwrap import BwrapSandbox
from rollout_service.sandbox.local import LocalSandbox
from rollout_service.sandbox.singularity import SingularitySandbox

SANDBOXES: dict[str, type] = {
    "bwrap": BwrapSandbox,
    "singularity": SingularitySandbox,
    "local": LocalSandbox,
}


def reap_expired(redis_client: Any, hostname: Any = None) -> Any:
    """See ``registry.reap_expired`` (imported on use: the in-sandbox action server imports this
    package and must not pay for Redis and the wire models at every sandbox boot)."""
    from rollout_service.sandbox.registry import reap_expired as reap

    return reap(redis_client, hostname)


def needs_sandbox(tools: Iterable[str], harness: object) -> bool:
    """Whether an episode runs in a sandbox: it has tools beyond ``finish``, or an external harness."""
    return harness is not None or bool(set(tools) - {"finish"})


def create_sandbox(kind: str, spec: SandboxSpec, redis_client: Any = None) -> Sandbox:
    """A sandbox of ``kind`` for ``spec``, not started yet; registered in Redis on start if given."""
    if kind == "apptainer":
        kind = "singularity"
    if kind not in SANDBOXES:
        raise UnknownName("sandbox", kind, SANDBOXES)
    return SANDBOXES[kind](spec, redis_client)


__all__ = ["SANDBOXES", "Sandbox", "SandboxSpec", "create_sandbox", "needs_sandbox", "reap_expired"]
