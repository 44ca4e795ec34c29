"""workers/dispatch.py against a real Redis broker: what it publishes is what it counts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def run_with_broker(redis_url: str, code: str) -> dict:
    """Run ``code`` in a fresh process whose Celery app uses ``redis_url`` (no worker consumes it)."""
    env = {**os.environ, "ROLLOUT_REDIS_URL": redis_url, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_enqueued_chains_are_counted_queued_then_unacked_once_delivered(redis_client, redis_url):
    result = run_with_broker(redis_url, """
        import json
        import redis
        from workers import dispatch
        from workers.celery_app import app

        broker = redis.Redis.from_url(app.conf.broker_url)
        dispatch.enqueue_jobs(["job-a", "job-b", "job-c"])
        dispatch.enqueue_from("job-d", "run")
        before = dispatch.queue_lengths(broker)
        with app.connection_for_read() as connection:  # a consumer takes one message and does not ack it
            queue = connection.SimpleQueue("init", no_ack=False)
            message = queue.get(timeout=5)
            first = [message.headers["task"], message.headers["id"]]
            after = dispatch.queue_lengths(broker)
            message.requeue()
            queue.close()
        print(json.dumps({"before": before, "after": after, "first": first}))
    """)
    assert result["before"]["init"] == {"queued": 3, "unacked": 0}
    assert result["before"]["run"] == {"queued": 1, "unacked": 0}
    assert result["after"]["init"] == {"queued": 2, "unacked": 1}
    assert result["first"] == ["workers.init.init_job", "job-a.init"]


def test_served_queues_come_from_live_worker_heartbeats(redis_client, redis_url):
    redis_client.set("rollout:worker:init@a", "init", ex=60)
    redis_client.set("rollout:worker:pair@b", "run,eval", ex=60)
    result = run_with_broker(redis_url, """
        import json
        import redis
        from workers import dispatch
        from workers.celery_app import app

        print(json.dumps(sorted(dispatch.served_queues(redis.Redis.from_url(app.conf.broker_url)))))
    """)
    assert result == ["eval", "init", "run"]
