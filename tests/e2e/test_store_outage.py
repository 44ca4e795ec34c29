"""The state store killed under the service: Redis SIGKILLed twice while jobs are in every stage
(init preparing, run mid-turn, a harness waiting on its endpoint, eval grading, a batch's group
decisions) and while the trainer waits through the SDK. No job ends for it, and none runs twice."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from rollout_service.devtools.redis_server import RedisServer
from rollout_service.schemas import JobView
from tests.fixtures_service import Service, running_service
from tests.helpers import TOOL_LOOP_HARNESS, math_task, server_log, tool_call, wait_for

SLOW_CHECK = "def check(candidate):\n    import time\n    time.sleep(3)\n    assert candidate() == 1\n"


def kill_redis_for(service: Service, down_s: float) -> None:
    """SIGKILL the service's Redis; it comes back on its port with its AOF after ``down_s``."""
    server = service.redis_server
    assert server.process is not None
    server.process.kill()
    server.process.wait()
    time.sleep(down_s)
    service.redis_server = RedisServer(server.data_dir, port=server.port).start()


def statuses(service: Service, job_ids: list[str]) -> Counter:
    redis = service.redis()
    return Counter(redis.hget(f"rollout:job:{job_id}", "status").decode() for job_id in job_ids)


def test_redis_killed_twice_while_jobs_are_in_every_stage_ends_none_of_them_and_runs_none_twice(
    tmp_path: Path, scripted_server, tiny_tokenizer_dir
) -> None:
    tag = uuid.uuid4().hex[:6]
    tool_problem, harness_problem, code_problem, batch_problem = (
        f"{what} ({tag})" for what in ("Tools", "Harness", "Code", "Batch")
    )
    backend_url = scripted_server(
        {
            "episodes": [
                {
                    "match": tool_problem,
                    "turns": [
                        {"text": tool_call("bash", command="echo mid-turn"), "delay_s": 2.0},
                        {"text": tool_call("finish", answer="\\boxed{4}"), "delay_s": 1.0},
                    ],
                },
                {"match": "REWRITE-MARKER", "turns": ["Summary: 4"]},
                {"match": harness_problem, "turns": [{"text": "The answer is \\boxed{4}.", "delay_s": 2.0}]},
                {
                    "match": code_problem,
                    "turns": [tool_call("finish", answer="```python\ndef f():\n    return 1\n```")],
                },
                {"match": batch_problem, "turns": [{"text": tool_call("finish", answer="4"), "delay_s": 1.0}]},
            ]
        }
    )
    with (
        running_service(
            tmp_path / "svc",
            ROLLOUT_LEASE_TTL_S="3",
            ROLLOUT_INIT_IN_RUN="0",  # math prepares in init
            ROLLOUT_SCORE_IN_RUN="0",  # and is graded in eval
            ROLLOUT_BACKEND_PROBE_INTERVAL_S="1",
        ) as service,
        service.client() as client,
    ):
        client.add_backend(backend_url, "vllm", "outage", tokenizer=str(tiny_tokenizer_dir))
        tools = client.submit(math_task(tool_problem), n=6, agent={"tools": ["bash", "finish"]}).job_ids
        harness = client.submit(
            math_task(harness_problem), n=2, agent={"harness": {"command": ["python", "-c", TOOL_LOOP_HARNESS]}}
        ).job_ids
        code = client.submit(
            {"domain": "code", "prompt": f"# {code_problem}\n", "test": SLOW_CHECK, "entry_point": "f"}, n=4
        ).job_ids
        batch = client.batch(
            [math_task(batch_problem)] * 3, group_size=2, target_groups=3, progress=False, timeout_s=240
        )
        job_ids = tools + harness + code
        waited: dict[str, list[JobView] | BaseException] = {}

        def wait() -> None:
            try:
                waited["views"] = client.wait(job_ids, timeout_s=240)
            except BaseException as exc:
                waited["views"] = exc

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        wait_for(
            lambda: statuses(service, code)["evaluating"] >= 1 and len(server_log(backend_url)) >= 6,
            120,
            "code jobs in grading and tool episodes mid-turn",
        )
        phases = [statuses(service, job_ids)]
        kill_redis_for(service, 2.0)  # grading, episodes mid-turn, harness calls, stage ends
        time.sleep(1.5)
        late = client.submit(math_task(tool_problem), n=12, agent={"tools": ["bash", "finish"]}).job_ids
        phases.append(statuses(service, job_ids + late))
        kill_redis_for(service, 1.0)  # the new jobs' init; what the first restart set going: begins, hand-offs
        waiter.join(300)
        late_views = client.wait(late, timeout_s=120)
        groups = batch.groups()
        trajectories = client.trajectories(tools + late)

    views = waited.get("views")
    assert isinstance(views, list), f"the SDK's wait did not ride out the restarts: {views!r}"
    views += late_views
    job_ids += late
    assert all(phase.total() - phase["completed"] for phase in phases), phases  # jobs were live at each kill
    assert Counter(v.status.value for v in views) == {"completed": len(job_ids)}, [
        (v.job_id, v.status.value, v.attempts, v.error) for v in views if v.status.value != "completed"
    ]
    assert all(v.reward == 1.0 for v in views), [(v.job_id, v.reward, v.result) for v in views if v.reward != 1.0]
    for job_id in tools + late:  # one episode each, not two spliced
        assert [t.kind for t in trajectories[job_id].turns].count("generation") == 2, trajectories[job_id].turns
    assert len(groups) == 3 and all(r.reward == 1.0 for g in groups for r in g.rollouts)
