"""Singularity / Apptainer sandboxes, driven through spython.

``singularity exec --containall --cleanenv --writable-tmpfs --no-home --net --network none``
with the workspace and the socket directory bound in; the action server is the image's
``/opt/rollout-runtime/bin/python`` (see ``sandbox_images/``). Images given as ``docker://``
references or ``.def`` files are converted to ``.sif`` once per image, under a file lock.
spython pitfalls handled here: flags go in ``options`` (``contain=`` is ignored), commands are
lists (strings are split on spaces), ``build`` gets ``sudo=False``, and the binary it names
(``singularity``) is swapped for ``apptainer`` when only that is installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from rollout_service.errors import SandboxError
from rollout_service.sandbox.base import (
    INNER_SOCKET,
    INNER_SOCKET_DIR,
    INNER_WORKSPACE,
    SandboxSpec,
    ServerSandbox,
    server_arguments,
)
from rollout_service.settings import get_settings

RUNTIME_PREFIX = "/opt/rollout-runtime"
RUNTIME_PYTHON = f"{RUNTIME_PREFIX}/bin/python"
RUNTIME_PACKAGES = f"{RUNTIME_PREFIX}/lib/rollout"
CONTAINMENT_FLAGS = ["--containall", "--cleanenv", "--writable-tmpfs", "--no-home", "--net", "--network", "none"]
REMOTE_SCHEMES = ("docker://", "docker-archive:", "oras://", "library://", "shub://")


def singularity_binary() -> str:
    for name in ("singularity", "apptainer"):
        path = shutil.which(name)
        if path:
            return path
    raise SandboxError(
        "neither singularity nor apptainer is on PATH: install Apptainer (or load its module), "
        "or set ROLLOUT_SANDBOX=bwrap"
    )


def _client() -> Any:
    from spython.main import Client

    return Client


def singularity_argv(spec: SandboxSpec, image: str, socket_dir: str) -> list[str]:
    """The exec command that runs the action server from the image's runtime prefix."""
    for host_dir in (spec.workspace, socket_dir):
        if not os.path.isdir(host_dir):  # spython would sys.exit() on a missing bind source
            raise SandboxError(f"cannot bind {host_dir} into the container: it does not exist")
    client = _client()
    options = [*CONTAINMENT_FLAGS, "--pwd", INNER_WORKSPACE]
    for key, value in sorted(spec.env.items()):
        options += ["--env", f"{key}={value}"]
    for path in spec.read_only:
        options += ["--bind", f"{path}:{path}:ro"]
    command = [
        RUNTIME_PYTHON,
        *server_arguments(spec, INNER_SOCKET, INNER_WORKSPACE, [RUNTIME_PACKAGES], run_site=True),
    ]
    argv = client._init_command("exec")
    argv += client._generate_bind_list([f"{spec.workspace}:{INNER_WORKSPACE}", f"{socket_dir}:{INNER_SOCKET_DIR}"])
    argv += options + [image] + command
    argv[0] = singularity_binary()
    return argv


def image_cache_dir() -> Path:
    return get_settings().state_path / "images"


def ensure_image(image: str | None, cache_dir: Path | None = None) -> str:
    """A local .sif for ``image``: as is, or converted once (under a lock) from docker:// or a .def."""
    if not image:
        raise SandboxError(
            "a singularity sandbox needs an image: a .sif path, a docker:// reference or a "
            "sandbox_images/*.def file (give it in the task or the sandbox spec)"
        )
    if image.endswith(".sif"):
        if not os.path.isfile(image):
            raise SandboxError(f"image {image} does not exist; build it with sandbox_images/build.sh")
        return image
    is_definition = image.endswith(".def")
    if is_definition:
        if not os.path.isfile(image):
            raise SandboxError(f"definition file {image} does not exist")
        source_id = image + Path(image).read_text()
    elif image.startswith(REMOTE_SCHEMES):
        source_id = image
    else:
        raise SandboxError(
            f"image {image!r} is neither a .sif file, a .def file nor a docker:// (or oras://) reference"
        )
    cache_dir = cache_dir or image_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(source_id.encode()).hexdigest()[:20]
    target = cache_dir / f"{name}.sif"
    with open(cache_dir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return str(target)
        partial = cache_dir / f"{name}.partial.sif"
        options = ["--force"]
        if is_definition and os.geteuid() != 0:
            options.append("--fakeroot")
        result = _client().build(
            recipe=image, image=str(partial), sudo=False, options=options, quiet=True, return_result=True
        )
        if not partial.exists():
            message = (result or {}).get("message") if isinstance(result, dict) else result
            raise SandboxError(f"building {image} into a .sif failed: {message}")
        partial.rename(target)
    return str(target)


class SingularitySandbox(ServerSandbox):
    kind = "singularity"

    def inside(self) -> tuple[str, str, str]:
        return RUNTIME_PYTHON, RUNTIME_PACKAGES, INNER_SOCKET_DIR

    def _prepare(self) -> None:
        self._image = ensure_image(self.spec.image)

    def _launch(self) -> tuple[list[str], dict[str, Any]]:
        assert self.socket_dir is not None
        return singularity_argv(self.spec, self._image, self.socket_dir), {}
