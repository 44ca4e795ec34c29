"""Worker process set-up (workers/celery_app.py), seen from outside a real service's workers."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rollout_service.sandbox.base import descendants
from tests.fixtures_service import running_service
from tests.test_sandbox import command_of, parent_of


@pytest.mark.skipif(os.geteuid() != 0, reason="the fork server serves root workers")
def test_each_eval_child_starts_its_sandbox_fork_server_before_any_grading(tmp_path: Path) -> None:
    with running_service(tmp_path / "svc", ROLLOUT_EVAL_CONCURRENCY="2") as service:
        eval_worker, = [c.process.pid for c in service.supervisor.children if c.name == "worker-eval"]
        deadline = time.monotonic() + 30
        while True:
            pool = [pid for pid in descendants(eval_worker) if parent_of(pid) == eval_worker]
            warmed = [child for child in pool
                      if any("rollout_service.tools.zygote" in command_of(p) for p in descendants(child))]
            if len(pool) == 2 and len(warmed) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(pool) == 2 and warmed == pool, [command_of(p) for c in pool for p in descendants(c)]
