"""rollout_service/concurrency/broker.py's picture of kombu's Redis transport, checked against kombu itself."""

from __future__ import annotations

from rollout_service.concurrency import broker


def test_every_priority_of_a_queue_lands_in_the_lists_the_broker_module_counts(
    redis_client, redis_url, celery_app
) -> None:
    app = celery_app(redis_url)
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue("probe")
        for priority in range(10):
            queue.put({"n": priority}, priority=priority)
    stored = {key.decode() for key in redis_client.scan_iter("probe*")}

    assert stored and stored <= set(broker.queue_keys("probe"))
    assert len(stored) > 1  # several priority steps
    assert broker.queue_lengths(redis_client, ["probe"]) == {"probe": {"queued": 10, "unacked": 0}}


def test_a_message_delivered_and_not_acked_is_counted_unacked_under_its_queue(
    redis_client, redis_url, celery_app
) -> None:
    app = celery_app(redis_url)
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue("probe", no_ack=False)
        queue.put({"n": 1}, headers={broker.JOBS_HEADER: ["job-a.run"], "id": "task-a"})
        queue.put({"n": 2})
        queue.get(timeout=5)

        assert broker.queue_lengths(redis_client, ["probe"]) == {"probe": {"queued": 1, "unacked": 1}}
        assert broker.messages_present(redis_client, ["probe"], ["job-a.run", "job-b.run"]) == {"job-a.run"}
        (raw,) = redis_client.hvals(broker.UNACKED_KEY)
        assert broker.unacked_route(raw) == ("probe", "task-a")  # Celery puts the task id in this header
    assert broker.unacked_route(b"not json") == ("", "")


def test_patching_the_poller_twice_wraps_it_once() -> None:
    from kombu.transport import redis as kombu_redis

    broker.wake_soon_when_paused()
    patched = kombu_redis.MultiChannelPoller.get
    broker.wake_soon_when_paused()
    assert kombu_redis.MultiChannelPoller.get is patched and getattr(patched, "_rollout_patched", False)
