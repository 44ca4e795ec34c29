"""Worker process set-up (workers/celery_app.py), seen from outside a real service's workers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis

from rollout_service.sandbox.processes import descendants
from tests.fixtures_service import running_service
from tests.helpers import command_of, parent_of, run_with_broker


@pytest.mark.skipif(os.geteuid() != 0, reason="the fork server serves root workers")
def test_each_eval_child_starts_its_sandbox_fork_server_before_any_grading(tmp_path: Path) -> None:
    with running_service(tmp_path / "svc", ROLLOUT_EVAL_CONCURRENCY="2") as service:
        (eval_worker,) = [c.process.pid for c in service.supervisor.children if c.name == "worker-eval"]
        deadline = time.monotonic() + 30
        while True:
            pool = [pid for pid in descendants(eval_worker) if parent_of(pid) == eval_worker]
            warmed = [
                child
                for child in pool
                if any("rollout_service.tools.zygote" in command_of(p) for p in descendants(child))
            ]
            if len(pool) == 2 and len(warmed) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(pool) == 2 and warmed == pool, [command_of(p) for c in pool for p in descendants(c)]


@pytest.mark.parametrize("hard_limit", [0, 600], ids=["the system's hard limit", "a hard limit of 600"])
def test_a_worker_takes_its_hard_open_file_limit_and_warns_when_even_that_is_short(redis_client, redis_url, hard_limit):
    result = run_with_broker(
        redis_url,
        f"""
        import json, logging, resource
        hard = {hard_limit} or resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # many systems start a process with 1,024
        from celery.signals import celeryd_init
        from workers import celery_app
        warnings = []
        logging.getLogger("workers.celery_app").addHandler(type("H", (logging.Handler,), {{
            "emit": lambda self, record: warnings.append(record.getMessage())}})())
        celeryd_init.send(sender="run@test", instance=None, conf=celery_app.app.conf,
                          options={{"concurrency": 200, "queues": ""}})
        print(json.dumps({{"limit": resource.getrlimit(resource.RLIMIT_NOFILE), "hard": hard, "warnings": warnings,
                          "slots": celery_app.worker_slots}}))
    """,
    )
    assert result["slots"] == 200 and result["limit"] == [result["hard"], result["hard"]]
    if hard_limit:  # 200 slots need more than 600
        assert (
            len(result["warnings"]) == 1
            and "ulimit -Hn" in result["warnings"][0]
            and "concurrency of 200" in result["warnings"][0]
        )
    elif result["hard"] >= 5000:
        assert result["warnings"] == []


def test_publishing_many_messages_reuses_one_redis_client_and_every_message_arrives(
    redis_client, redis_url, celery_app, monkeypatch
):
    app = celery_app(redis_url)
    made = []
    original = redis.Redis.__init__

    def counting(self: redis.Redis, *args: object, **kwargs: object) -> None:
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "__init__", counting)
    for n in range(50):
        app.send_task("probe", args=[n], queue="probe-queue")
    assert len(made) <= 3  # kombu's own Channel makes one per message: 50 or more (none: a channel made earlier)
    assert redis_client.llen("probe-queue") == 50


def test_an_app_is_configured_from_the_settings_it_is_built_with(redis_url):
    from rollout_service.settings import Settings
    from workers.celery_app import create_app

    app = create_app(
        Settings.from_env(
            {
                "ROLLOUT_REDIS_URL": redis_url,
                "ROLLOUT_BROKER_URL": redis_url + "1",
                "ROLLOUT_JOB_DEADLINE_S": "9000",
                "ROLLOUT_VISIBILITY_TIMEOUT_S": "60",
            }
        )
    )
    assert app.conf.broker_url == redis_url + "1"
    assert app.conf.broker_transport_options == {"visibility_timeout": 18000}  # twice the longest job deadline
    assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost and app.conf.worker_prefetch_multiplier == 1
    with app.connection_for_write() as connection:
        assert type(connection.transport).__module__ == "rollout_service.concurrency.broker"
