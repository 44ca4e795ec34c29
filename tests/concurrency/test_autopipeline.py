"""The green workers' Redis client against a real Redis, in a gevent-patched process as a worker runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def run_green(redis_url: str, code: str) -> dict:
    program = "from gevent import monkey; monkey.patch_all()\n" + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd(), "REDIS_URL": redis_url},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_many_greenlets_share_round_trips_and_each_gets_its_own_reply(redis_client, redis_url):
    result = run_green(
        redis_url,
        """
        import json, os
        import gevent, redis
        from rollout_service.concurrency.autopipeline import AutoPipelineRedis
        from rollout_service.state.connection import client_class

        client = AutoPipelineRedis.from_url(os.environ["REDIS_URL"])
        count = client.register_script("return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)")
        round_trips = [0]
        execute = redis.client.Pipeline.execute
        def counted(self, *args, **kwargs):
            round_trips[0] += 1
            return execute(self, *args, **kwargs)
        redis.client.Pipeline.execute = counted

        def episode(n):
            return [count(keys=["counts"], args=[f"g{n}"]) for _ in range(20)]
        replies = [g.value for g in gevent.joinall([gevent.spawn(episode, n) for n in range(200)])]
        pipe = client.pipeline(transaction=False)
        pipe.set("a", "1")
        count(keys=["counts"], args=["piped"], client=pipe)
        pipe.get("a")
        piped = pipe.execute()
        try:
            client.hget("a", "x")  # a wrong-type error reaches its caller only
            wrong = None
        except redis.ResponseError as exc:
            wrong = type(exc).__name__
        print(json.dumps({"replies_ok": all(r == list(range(1, 21)) for r in replies),
                          "total": sum(int(v) for v in client.hvals("counts")), "round_trips": round_trips[0],
                          "piped": [piped[0], piped[1], piped[2].decode()], "wrong": wrong,
                          "green_class": client_class().__name__}))
    """,
    )
    assert result["replies_ok"] and result["total"] == 200 * 20 + 1
    assert result["round_trips"] < 200 * 20 / 10, result["round_trips"]
    assert result["piped"] == [True, 1, "1"] and result["wrong"] == "ResponseError"
    assert result["green_class"] == "AutoPipelineRedis"


def test_commands_issued_within_the_linger_of_a_busy_worker_share_one_round_trip_and_none_otherwise(
    redis_client, redis_url
):
    result = run_green(
        redis_url,
        """
        import json, os, time
        import gevent, redis
        from rollout_service.concurrency.autopipeline import AutoPipelineRedis
        from rollout_service.settings import get_settings
        from rollout_service.state.connection import redis_client

        round_trips = [0]
        execute = redis.client.Pipeline.execute
        def counted(self, *args, **kwargs):
            round_trips[0] += 1
            return execute(self, *args, **kwargs)
        redis.client.Pipeline.execute = counted

        def staggered(client):
            def one(n):
                gevent.sleep(n * 0.001)  # 20 episodes whose turns end 1 ms apart (timers fire in that order)
                return client.incr(f"staggered:{n}")
            before, began = round_trips[0], time.monotonic()
            replies = [g.value for g in gevent.joinall([gevent.spawn(one, n) for n in range(20)])]
            return replies, round_trips[0] - before, time.monotonic() - began

        os.environ["ROLLOUT_REDIS_URL"] = os.environ["REDIS_URL"]
        os.environ["ROLLOUT_REDIS_BATCH_LINGER_MS"] = "1000"
        get_settings.cache_clear()
        lingering = redis_client()
        lingering.busy = lambda: True  # as a run worker running many episodes sets it
        gathered, gathered_trips, gathered_s = staggered(lingering)
        at_once, at_once_trips, at_once_s = staggered(AutoPipelineRedis.from_url(os.environ["REDIS_URL"]))
        lingering.busy = lambda: False  # a run worker with few episodes, or any other green process
        idle, idle_trips, idle_s = staggered(lingering)
        print(json.dumps({"linger_s": lingering.linger_s, "gathered": gathered, "gathered_trips": gathered_trips,
                          "at_once": at_once, "at_once_trips": at_once_trips, "idle_trips": idle_trips,
                          "gathered_s": gathered_s, "at_once_s": at_once_s, "idle_s": idle_s}))
    """,
    )
    assert result["linger_s"] == 1.0  # from ROLLOUT_REDIS_BATCH_LINGER_MS
    assert result["gathered"] == [1] * 20 and result["at_once"] == [2] * 20
    # the last command comes 19 ms after the first, well inside the linger whatever the load
    assert result["gathered_trips"] == 1 and result["gathered_s"] >= 1.0, result
    # without a linger the first round trip leaves at once: the commands after it take more
    assert result["at_once_trips"] >= 2 and result["idle_trips"] >= 2, result
    assert max(result["at_once_s"], result["idle_s"]) < result["gathered_s"] / 2, result


def test_fired_calls_run_in_order_with_later_ones_even_after_the_server_forgot_its_scripts(redis_client, redis_url):
    result = run_green(
        redis_url,
        """
        import json, os
        from rollout_service.concurrency.autopipeline import AutoPipelineRedis, fire

        client = AutoPipelineRedis.from_url(os.environ["REDIS_URL"])
        count = client.register_script("return redis.call('INCR', KEYS[1])")
        for _ in range(5):
            fire(client, count, keys=["fired"])
        first = int(client.get("fired"))
        client.script_flush()  # as after a Redis restart
        for _ in range(3):
            fire(client, count, keys=["fired"])
        pipe = client.pipeline(transaction=False)
        count(keys=["fired"], client=pipe)
        after = pipe.execute()[0]
        print(json.dumps({"first": first, "after": after}))
    """,
    )
    assert result == {"first": 5, "after": 9}


def test_outside_gevent_a_pipeline_loads_its_script_once_and_again_after_the_server_forgot_it(redis_url):
    import redis

    from rollout_service.concurrency.autopipeline import ScriptLoadingRedis
    from rollout_service.state.connection import client_class

    client = ScriptLoadingRedis.from_url(redis_url)
    count = client.register_script("return redis.call('INCR', KEYS[1])")

    def exists_calls() -> int:
        stats = client.info("commandstats")
        return stats.get("cmdstat_script|exists", {}).get("calls", 0)

    before = exists_calls()
    replies = []
    for _ in range(5):
        pipe = client.pipeline(transaction=False)
        pipe.set("plain", "x")
        count(keys=["counted"], client=pipe)
        replies.append(pipe.execute()[1])
    client.script_flush()
    pipe = client.pipeline(transaction=False)
    count(keys=["counted"], client=pipe)
    pipe.get("plain")
    after_flush = pipe.execute()
    assert replies == [1, 2, 3, 4, 5] and after_flush == [6, b"x"]
    assert exists_calls() == before
    pipe = client.pipeline(transaction=False)
    pipe.hget("plain", "field")
    try:
        pipe.execute()
        raise AssertionError("a wrong-type command must raise")
    except redis.ResponseError:
        pass
    assert client_class() is ScriptLoadingRedis  # this test process is not green


def test_outside_gevent_a_submitted_script_answers_later_with_its_reply_or_its_error(redis_url):
    import pytest
    import redis

    from rollout_service.concurrency.autopipeline import submit

    client = redis.Redis.from_url(redis_url)
    answer = submit(client, client.register_script("return redis.call('INCR', KEYS[1])"), keys=["submitted"])
    assert answer() == 1
    client.set("not-a-hash", "x")
    failing = submit(client, client.register_script("return redis.call('HGET', KEYS[1], 'f')"), keys=["not-a-hash"])
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        failing()
