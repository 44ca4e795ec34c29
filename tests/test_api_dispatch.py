"""workers/dispatch.py against a real Redis broker: what it publishes is what it counts."""
from __future__ import annotations

from tests.helpers import run_with_broker


def test_jobs_travel_in_messages_of_at_most_the_batch_size_counted_queued_then_unacked(redis_client, redis_url):
    result = run_with_broker(redis_url, """
        import json
        import redis
        from workers import dispatch
        from workers.celery_app import app

        broker = redis.Redis.from_url(app.conf.broker_url)
        dispatch.enqueue_jobs(["job-a", "job-b", "job-c", "job-d", "job-e"], "init")
        dispatch.enqueue_from("job-f", "run")
        before = dispatch.queue_lengths(broker)
        with app.connection_for_read() as connection:  # a consumer takes one message and does not ack it
            queue = connection.SimpleQueue("init", no_ack=False)
            message = queue.get(timeout=5)
            first = {"task": message.headers["task"], "id": message.headers["id"], "args": message.payload[0],
                     "marks": message.headers[dispatch.JOBS_HEADER]}
            after = dispatch.queue_lengths(broker)
            message.requeue()
            queue.close()
        print(json.dumps({"before": before, "after": after, "first": first}))
    """, ROLLOUT_STAGE_BATCH_MAX_JOBS="2")
    assert result["before"]["init"] == {"queued": 3, "unacked": 0}
    assert result["before"]["run"] == {"queued": 1, "unacked": 0}
    assert result["after"]["init"] == {"queued": 2, "unacked": 1}
    assert result["first"] == {"task": "workers.init.init_jobs", "id": "job-a.init+1", "args": [["job-a", "job-b"]],
                               "marks": ["job-a.init", "job-b.init"]}


def test_messages_present_finds_jobs_inside_batched_messages_across_scan_chunks_and_in_unacked(
        redis_client, redis_url):
    result = run_with_broker(redis_url, """
        import json
        import redis
        from workers import dispatch
        from workers.celery_app import app

        broker = redis.Redis.from_url(app.conf.broker_url)
        dispatch.SCAN_CHUNK = 4  # many chunks for a few messages
        dispatch.enqueue_jobs([f"job-{i:03d}" for i in range(40)], "init")  # 14 messages of up to 3 jobs
        with app.connection_for_read() as connection:  # one delivered, not acked: it sits in unacked
            queue = connection.SimpleQueue("init", no_ack=False)
            delivered = queue.get(timeout=5).headers[dispatch.JOBS_HEADER]
            asked = ["job-000.init", "job-013.init", "job-014.init", "job-039.init", "job-000.run", "nobody.init"]
            print(json.dumps({"present": sorted(dispatch.messages_present(broker, asked + delivered)),
                              "delivered": delivered}))
            queue.close()
    """, ROLLOUT_STAGE_BATCH_MAX_JOBS="3")
    assert len(result["delivered"]) == 3
    assert result["present"] == sorted({"job-000.init", "job-013.init", "job-014.init", "job-039.init",
                                        *result["delivered"]})


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


def test_scoring_meets_a_stalled_redis_as_a_transient_error_to_retry_not_an_internal_error(redis_client, redis_url):
    result = run_with_broker(redis_url, """
        import json, threading, time
        import redis
        from rollout_service.errors import StoreUnavailable
        from workers.eval import score_submission
        from workers.stage import job_store

        store = job_store()
        store.put_blob("score-stall", "score-request",
                       {"task": {"domain": "math", "problem": "2+2", "answer": "4"}, "submission": {"answer": "4"}})
        pauser = redis.Redis.from_url(store.settings.redis_url)
        pauser.execute_command("CLIENT", "PAUSE", "1500", "ALL")
        try:
            score_submission("score-stall")  # called directly: Celery re-raises what it would retry
            outcome = "scored"
        except StoreUnavailable as exc:
            outcome = "transient: " + str(exc)[:60]
        time.sleep(1.6)
        stored = store.redis.lrange(store.key("score-stall", "score-result"), 0, -1)
        score_submission("score-stall")  # Redis is back: the retry scores it
        after = [json.loads(r) for r in store.redis.lrange(store.key("score-stall", "score-result"), 0, -1)]
        print(json.dumps({"outcome": outcome, "stored_during_stall": len(stored), "after": after}))
    """, ROLLOUT_REDIS_SOCKET_TIMEOUT_S="0.2", ROLLOUT_REDIS_RETRIES="0")
    assert result["outcome"].startswith("transient: Redis is unreachable or not answering")
    assert result["stored_during_stall"] == 0
    assert result["after"] == [{"reward": 1.0, "details": result["after"][0]["details"]}]


def test_the_handoff_sends_a_lone_job_at_once_and_gathers_those_that_follow_within_its_window(redis_client, redis_url):
    result = run_with_broker(redis_url, """
        import json
        import threading
        import redis
        from workers import dispatch
        from workers.celery_app import app

        broker = redis.Redis.from_url(app.conf.broker_url)
        handoff = dispatch.Handoff(window_s=2.0, max_jobs=4)
        lone = handoff.put("eval", "job-lone")
        counts = {"lone_at_once": lone.is_set() and broker.llen("eval") == 1}
        published = []
        threads = [threading.Thread(target=lambda i=i: published.append(handoff.put("eval", f"job-{i}")))
                   for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        counts.update(before_window=broker.llen("eval"), all_published=all(e.wait(5) for e in published))
        with app.connection_for_read() as connection:
            queue = connection.SimpleQueue("eval", no_ack=True)
            marks = [queue.get(timeout=5).headers[dispatch.JOBS_HEADER] for _ in range(broker.llen("eval"))]
            queue.close()
        print(json.dumps({**counts, "marks": marks}))
    """)
    assert result["lone_at_once"]
    assert result["before_window"] == 2  # the lone job's message, and the first four of the six, which filled one
    assert result["all_published"]
    assert sorted(len(m) for m in result["marks"]) == [1, 2, 4]
    assert sorted(x for m in result["marks"] for x in m) == sorted([f"job-{i}.eval" for i in range(6)] + ["job-lone.eval"])
