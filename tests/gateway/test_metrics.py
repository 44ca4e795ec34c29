"""/metrics: Prometheus text that prometheus_client's parser reads; counters and histograms kept
in Redis move as jobs run through the real service; queue depth counts reserved messages."""

from __future__ import annotations

import json
import time
import uuid

import httpx
from kombu import Connection
from prometheus_client.parser import text_string_to_metric_families

from rollout_service.gateway.metrics import queue_depths

HISTOGRAMS = (
    "rollout_stage_duration_seconds",
    "rollout_llm_call_seconds",
    "rollout_tool_seconds",
    "rollout_sandbox_boot_seconds",
)


def scrape(url: str) -> list:
    text = httpx.get(f"{url}/metrics").text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def value(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_finished_jobs_move_counters_and_histograms_of_stages_llm_calls_tools_and_boots(
    service, client, scripted_backend
):
    marker = uuid.uuid4().hex[:6]
    scripted_backend(
        {
            "episodes": [
                {
                    "match": f"tool {marker}",
                    "turns": [tool_call("ipython", code="print(2 + 2)"), tool_call("finish", answer="\\boxed{4}")],
                },
                {"match": f"plain {marker}", "turns": ["\\boxed{4}"]},
            ]
        }
    )
    before = scrape(service.url)
    job_ids = [
        client.submit({"domain": "math", "problem": f"{kind} {marker}", "answer": "4"}).job_ids[0]
        for kind in ("tool", "plain")
    ]
    views = client.wait(job_ids, timeout_s=120)
    assert [v.status.value for v in views] == ["completed", "completed"], [v.error for v in views]
    # a job's end is announced in the round trip that ends it, its metrics in the next one: a
    # scrape right after the trainer saw the end may come between the two
    deadline = time.monotonic() + 10
    while True:
        after = scrape(service.url)
        if (
            value(after, "rollout_jobs_finished_total") - value(before, "rollout_jobs_finished_total") >= 2
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.05)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("rollout_jobs_finished_total", status="completed", finish_reason="finished") == 1
    assert moved("rollout_jobs_finished_total", status="completed", finish_reason="no_tool_call") == 1
    for stage in ("queued", "init", "run", "eval"):
        assert moved("rollout_stage_duration_seconds_count", stage=stage) == 2
        assert moved("rollout_stage_duration_seconds_sum", stage=stage) > 0
    assert moved("rollout_llm_call_seconds_count") == 3
    assert moved("rollout_tool_seconds_count") == 1
    assert moved("rollout_sandbox_boot_seconds_count") == 2
    for name in HISTOGRAMS:
        for series in {
            tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in after if s.name == f"{name}_bucket"
        }:
            labels = dict(series)
            buckets = [s for s in after if s.name == f"{name}_bucket" and labels.items() <= s.labels.items()]
            counts = [s.value for s in buckets]
            assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf"
            assert counts[-1] == value(after, f"{name}_count", **labels)
    assert value(after, "rollout_sandboxes_alive") == 0
    assert value(after, "rollout_queue_depth", queue="run") == 0


def test_backend_assignments_are_a_counter_that_grows_with_each_job(service, client, scripted_backend):
    marker = uuid.uuid4().hex[:6]
    backend = scripted_backend({"episodes": [{"match": marker, "turns": ["\\boxed{4}"]}]}, model=f"m-{marker}")
    client.wait(client.submit({"domain": "math", "problem": marker, "answer": "4"}, n=3).job_ids, timeout_s=120)
    text = httpx.get(f"{service.url}/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "rollout_backend_assignments"]
    assert family.type == "counter"
    assert value(family.samples, "rollout_backend_assignments_total", backend=backend.id) == 3


def test_queue_depth_counts_messages_reserved_by_a_worker_but_not_started(redis_client, redis_url):
    redis_client.hset("rollout:job:job-waiting", "status", "initializing")
    redis_client.hset("rollout:job:job-started", "status", "running")
    with Connection(redis_url) as connection:
        queue = connection.SimpleQueue("run")
        queue.consumer.qos(prefetch_count=2)  # a worker with two slots
        for job_id in ("job-waiting", "job-started", "job-in-list"):
            queue.put({}, headers={"id": f"{job_id}.run"})
        reserved = [queue.get(timeout=5), queue.get(timeout=5)]  # unacked: kombu keeps them in 'unacked'
        assert sorted(m.headers["id"] for m in reserved) == ["job-started.run", "job-waiting.run"]
        assert queue_depths(redis_client)["run"] == (1, 1)
        for message in reserved:
            message.ack()
        assert queue_depths(redis_client)["run"] == (1, 0)
        queue.close()


def test_a_job_delivered_three_times_to_run_counts_two_redeliveries_when_it_ends(redis_client):
    from rollout_service.gateway.metrics import render
    from rollout_service.state.metrics_recording import record_job_finished

    record_job_finished(
        redis_client,
        {
            "status": "failed",
            "attempts_init": "1",
            "attempts_run": "3",
            "created_at": "100",
            "init_start": "101",
            "init_end": "103",
        },
    )
    samples = [s for f in text_string_to_metric_families(render(redis_client)) for s in f.samples]
    assert value(samples, "rollout_stage_redeliveries_total", stage="run") == 2
    assert value(samples, "rollout_stage_redeliveries_total", stage="init") == 0
    assert value(samples, "rollout_jobs_finished_total", status="failed", finish_reason="none") == 1
    assert value(samples, "rollout_stage_duration_seconds_sum", stage="init") == 2
    assert value(samples, "rollout_stage_duration_seconds_bucket", stage="queued", le="1.0") == 1
    assert value(samples, "rollout_stage_duration_seconds_count", stage="run") == 0


def test_a_green_worker_writes_the_metrics_of_many_episodes_together_and_what_is_left_when_it_stops(
    redis_client, redis_url
):
    from tests.helpers import run_with_broker

    def hincrbys() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_hincrby", {}).get("calls", 0))

    before = hincrbys()
    result = run_with_broker(
        redis_url,
        """
        from gevent import monkey; monkey.patch_all()
        import json, time, gevent, redis
        from rollout_service.concurrency.autopipeline import AutoPipelineRedis
        from rollout_service.state.metrics_recording import COUNTERS_KEY, Increments
        client = AutoPipelineRedis.from_url(__import__("os").environ["ROLLOUT_REDIS_URL"])
        plain = redis.Redis.from_url(__import__("os").environ["ROLLOUT_REDIS_URL"])
        def episode_ends():
            ended = Increments()
            ended.count("rollout_jobs_finished", {"status": "completed", "finish_reason": "finished"})
            ended.observe("rollout_llm_call_seconds", [1.002, 1.004])
            ended.write(client, "episode")
        for _ in range(200):
            episode_ends()
        gevent.sleep(0.1)
        early = plain.hget(COUNTERS_KEY, 'rollout_jobs_finished|status="completed",finish_reason="finished"')
        gevent.sleep(0.6)
        later = plain.hget(COUNTERS_KEY, 'rollout_jobs_finished|status="completed",finish_reason="finished"')
        for _ in range(5):
            episode_ends()  # the worker stops before the next write
        print(json.dumps({"early": early and int(early), "later": int(later)}))
    """,
        ROLLOUT_METRICS_FLUSH_S="0.5",
    )
    assert result == {"early": None, "later": 200}
    assert (
        int(
            redis_client.hget(
                "rollout:metrics:counters", 'rollout_jobs_finished|status="completed",finish_reason="finished"'
            )
        )
        == 205
    )
    assert int(redis_client.hget("rollout:metrics:histograms", "rollout_llm_call_seconds||count")) == 410
    assert hincrbys() - before <= 2 * 4  # two writes of a counter, a bucket and a count (200 writes each before)
