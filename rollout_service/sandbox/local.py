"""The ``local`` sandbox: the action server as a plain child process. No isolation at all:
for development on machines without bubblewrap, and only when asked for by name."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from rollout_service.sandbox.base import ServerSandbox, host_import_paths, package_root, server_arguments

log = logging.getLogger(__name__)


class LocalSandbox(ServerSandbox):
    kind = "local"

    def inside(self) -> tuple[str, str, str]:
        assert self.socket_dir is not None
        return sys.executable, package_root(), self.socket_dir

    def private_tmp(self) -> str:
        """The tools' temporary directory (``TMPDIR``), inside the socket directory: removed with it,
        even when the tools were killed before they could clean up."""
        assert self.socket_dir is not None
        path = os.path.join(self.socket_dir, "tmp")
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def _launch(self) -> tuple[list[str], dict[str, Any]]:
        log.warning(
            "LOCAL SANDBOX %s for job %s: NO ISOLATION. The agent's commands run as this user, with "
            "network access and write access to everything this user can write. Use ROLLOUT_SANDBOX=bwrap "
            "(apt-get install bubblewrap) or singularity for anything but development.",
            self.sandbox_id,
            self.spec.job_id,
        )
        env = self.sandbox_env()
        env["HOME"] = env["ROLLOUT_WORKSPACE"] = self.spec.workspace
        env["TMPDIR"] = self.private_tmp()
        argv = [
            sys.executable,
            *server_arguments(self.spec, self.socket_path, self.spec.workspace, host_import_paths()),
        ]
        return argv, {"cwd": self.spec.workspace, "env": env}
