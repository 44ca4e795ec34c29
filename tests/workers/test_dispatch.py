"""workers/dispatch.py against a real Redis broker: what it publishes is what it counts."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rollout_service.errors import StoreUnavailable


def test_jobs_travel_in_messages_of_at_most_the_batch_size_counted_queued_then_unacked(
    redis_client, redis_url, celery_app
):
    app = celery_app(redis_url, ROLLOUT_STAGE_BATCH_MAX_JOBS="2")
    from workers import dispatch

    dispatch.enqueue_jobs(["job-a", "job-b", "job-c", "job-d", "job-e"], "init")
    dispatch.enqueue_from("job-f", "run")
    before = dispatch.queue_lengths(redis_client)
    with app.connection_for_read() as connection:  # a consumer takes one message and does not ack it
        queue = connection.SimpleQueue("init", no_ack=False)
        message = queue.get(timeout=5)
        first = {
            "task": message.headers["task"],
            "id": message.headers["id"],
            "args": message.payload[0],
            "marks": message.headers[dispatch.JOBS_HEADER],
        }
        after = dispatch.queue_lengths(redis_client)
        message.requeue()
        queue.close()
    assert before["init"] == {"queued": 3, "unacked": 0}
    assert before["run"] == {"queued": 1, "unacked": 0}
    assert after["init"] == {"queued": 2, "unacked": 1}
    assert first == {
        "task": "workers.init.init_jobs",
        "id": "job-a.init+1",
        "args": [["job-a", "job-b"]],
        "marks": ["job-a.init", "job-b.init"],
    }


def test_messages_present_finds_jobs_inside_batched_messages_across_scan_chunks_and_in_unacked(
    redis_client, redis_url, celery_app, monkeypatch
):
    app = celery_app(redis_url, ROLLOUT_STAGE_BATCH_MAX_JOBS="3")
    from rollout_service.concurrency import broker
    from workers import dispatch

    monkeypatch.setattr(broker, "SCAN_CHUNK", 4)  # many chunks for a few messages
    dispatch.enqueue_jobs([f"job-{i:03d}" for i in range(40)], "init")  # 14 messages of up to 3 jobs
    with app.connection_for_read() as connection:  # one delivered, not acked: it sits in unacked
        queue = connection.SimpleQueue("init", no_ack=False)
        delivered = queue.get(timeout=5).headers[dispatch.JOBS_HEADER]
        asked = ["job-000.init", "job-013.init", "job-014.init", "job-039.init", "job-000.run", "nobody.init"]
        present = dispatch.messages_present(redis_client, asked + delivered)
        queue.close()
    assert len(delivered) == 3
    assert present == {"job-000.init", "job-013.init", "job-014.init", "job-039.init", *delivered}


def test_served_queues_come_from_live_worker_heartbeats(redis_client):
    from workers import dispatch

    redis_client.set("rollout:worker:init@a", "init", ex=60)
    redis_client.set("rollout:worker:pair@b", "run,eval", ex=60)
    assert dispatch.served_queues(redis_client) == {"eval", "init", "run"}


def test_scoring_meets_a_stalled_redis_as_a_transient_error_to_retry_not_an_internal_error(
    redis_client, redis_url, celery_app
):
    celery_app(
        redis_url, ROLLOUT_REDIS_SOCKET_TIMEOUT_S="0.2", ROLLOUT_REDIS_RETRIES="0", ROLLOUT_REDIS_OUTAGE_WAIT_S="0"
    )
    from workers.eval import score_submission
    from workers.stage import job_store

    store = job_store()
    store.put_blob(
        "score-stall",
        "score-request",
        {"task": {"domain": "math", "problem": "2+2", "answer": "4"}, "submission": {"answer": "4"}},
    )
    result_key = store.key("score-stall", "score-result")
    redis_client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    with pytest.raises(StoreUnavailable, match="Redis is unreachable or not answering"):
        score_submission("score-stall")  # called directly: Celery re-raises what it would retry
    time.sleep(1.6)
    assert redis_client.llen(result_key) == 0
    score_submission("score-stall")  # Redis is back: the retry scores it
    after = [json.loads(r) for r in redis_client.lrange(result_key, 0, -1)]
    assert after == [{"reward": 1.0, "details": after[0]["details"]}]


def test_the_handoff_sends_a_lone_job_at_once_and_gathers_those_that_follow_within_its_window(
    redis_client, redis_url, celery_app
):
    app = celery_app(redis_url)
    from workers import dispatch

    handoff = dispatch.Handoff(window_s=2.0, max_jobs=4)
    lone = handoff.put("eval", "job-lone")
    assert lone.is_set() and redis_client.llen("eval") == 1
    published: list[threading.Event] = []
    threads = [threading.Thread(target=lambda i=i: published.append(handoff.put("eval", f"job-{i}"))) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert redis_client.llen("eval") == 2  # the lone job's message, and the first four of the six, which filled one
    assert all(event.wait(5) for event in published)
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue("eval", no_ack=True)
        marks = [queue.get(timeout=5).headers[dispatch.JOBS_HEADER] for _ in range(redis_client.llen("eval"))]
        queue.close()
    assert sorted(len(m) for m in marks) == [1, 2, 4]
    assert sorted(x for m in marks for x in m) == sorted([f"job-{i}.eval" for i in range(6)] + ["job-lone.eval"])
