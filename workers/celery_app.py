"""The one Celery configuration every process shares (gateway, every worker pool, Flower).

Tasks and queues are named in workers/dispatch.py only, kombu's keys and internals in rollout_service/concurrency/broker.py. Reliability settings follow docs/architecture.md: late acks, reject on worker loss, prefetch 1, and a
visibility timeout above the longest job deadline, set identically everywhere.
"""

from __future__ import annotations

import gc
import importlib
import logging
import resource
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery.app.utils import Settings as CeleryConfig
from celery.signals import celeryd_init, worker_process_init, worker_ready
from celery.worker import state as worker_state

from rollout_service.concurrency import broker
from rollout_service.concurrency.green import collect_when_idle
from rollout_service.settings import Settings, get_settings
from rollout_service.state.connection import resolve_redis_url

log = logging.getLogger(__name__)

HEARTBEAT_KEY_PREFIX = "rollout:worker:"  # + worker hostname -> comma-separated queues it consumes
HEARTBEAT_INTERVAL_S = 5
WARM_INTERVAL_S = 2
GC_CHECK_S = 1.0
BROKER_SPARE_CONNECTIONS = 32  # the consumer's BRPOP, remote control, publishing the next stage
DESCRIPTORS_PER_SLOT = (
    6  # an episode's LLM and broker connections, its sandbox's socket, status pipe, log and uid lease
)
SPARE_DESCRIPTORS = 512  # Redis and broker pools, the fork server, libraries, logs
worker_slots = 0  # this worker's --concurrency (the largest of --autoscale); 0 outside a worker
consumer_qos: Any = None  # this worker's prefetch window (kombu.common.QoS), once it consumes


def create_app(settings: Settings | None = None) -> Celery:
    """The Celery app of every process, configured from ``settings``, or else from this process's
    settings when its configuration is first used (importing this module needs no Redis). The
    module's ``app`` is that one: the celery CLI (``-A workers.celery_app``) and the task modules
    use it; tests build their own."""
    app = Celery("rollout", include=["workers.init", "workers.run", "workers.eval", "workers.control"])
    app.add_defaults(lambda: celery_config(settings or get_settings()))
    return app


def celery_config(settings: Settings) -> dict[str, Any]:
    visibility_s = max(settings.visibility_timeout_s, int(settings.job_deadline_s) * 2)
    return dict(
        broker_url=settings.broker_url or resolve_redis_url(settings),
        broker_transport=broker.TRANSPORT,
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": visibility_s},
        result_backend_transport_options={"visibility_timeout": visibility_s},
        broker_connection_retry_on_startup=True,
        # a broker restart leaves running stages alone: their leases keep a redelivered message from
        # running them twice, and their jobs' records, not the broker, say what is done
        worker_cancel_long_running_tasks_on_connection_loss=False,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue="control",
        worker_send_task_events=settings.task_events,
        task_send_sent_event=False,  # one more broker round trip per publish; Flower starts at "received"
        worker_hijack_root_logger=False,
    )


app = create_app()


@celeryd_init.connect
def _size_to_slots(conf: CeleryConfig, options: dict[str, Any], **_: object) -> None:
    """Record this worker's slots and size what they use: the broker pool, the open-file limit.

    kombu's Redis transport gives each worker a pool of 10 broker connections that fails
    ("Too many connections") instead of waiting. A green pool acks from every task's greenlet,
    so hundreds of tasks ending together can exhaust it; kombu then drops the broker connection,
    and a message it has just popped off a queue but not yet recorded as unacked is lost. Size the
    pool to the worker's slots, and
    record them (a run worker runs that many jobs, however many its messages carry)."""
    autoscale = options.get("autoscale") or ()
    if isinstance(autoscale, str):
        autoscale = autoscale.split(",")
    slots = max([int(options.get("concurrency") or 0), *(int(n) for n in autoscale if str(n).strip())])
    global worker_slots
    worker_slots = slots
    conf.broker_transport_options = {
        **conf.broker_transport_options,
        "max_connections": slots + BROKER_SPARE_CONNECTIONS,
    }
    _raise_open_file_limit(slots)


def _raise_open_file_limit(slots: int) -> None:
    """A run worker's hundreds of episodes each hold a few descriptors, and many systems start
    processes with a soft limit of 1,024 (failing with "Too many open files" mid-run): take the
    hard limit, and say when even that is short of what ``slots`` need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = slots * DESCRIPTORS_PER_SLOT + SPARE_DESCRIPTORS
    if resource.RLIM_INFINITY not in (soft, hard) and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard != resource.RLIM_INFINITY and hard < needed:
        log.warning(
            "this worker may open %d files at most (ulimit -Hn) and its concurrency of %d needs ~%d; "
            "raise the hard limit or lower --concurrency",
            hard,
            slots,
            needed,
        )


# What a worker of each queue imports before it serves (prefork children inherit it; nothing is
# imported in the middle of the first jobs), and the objects gc.freeze() then takes out of the
# collector's sight.
PRELOAD = {
    "init": (
        "transformers.PreTrainedTokenizerFast",
        "transformers.AutoTokenizer",
        "jinja2",
        "rollout_service.concurrency.autopipeline",
    ),
    "run": (
        "transformers.PreTrainedTokenizerFast",
        "transformers.AutoTokenizer",
        "jinja2",
        "rollout_service.concurrency.autopipeline",
    ),
    "eval": ("math_verify", "rollout_service.concurrency.autopipeline"),
}


@celeryd_init.connect
def _preload_and_freeze(options: dict[str, Any], **_: object) -> None:
    """Freeze a worker's start-up objects once, after importing what its queues need: a full
    collection walks all of them (transformers alone brings tens of thousands), and a green worker
    answers none of its episodes while it runs."""
    queues = options.get("queues") or ""
    for queue in queues.split(",") if isinstance(queues, str) else queues:
        for name in PRELOAD.get(queue, ()):
            try:
                importlib.import_module(name)
            except ImportError:  # a package attribute (a lazy module's class): import it by name
                module, attribute = name.rsplit(".", 1)
                getattr(importlib.import_module(module), attribute)
    gc.collect()
    gc.freeze()


broker.wake_soon_when_paused()


def warm_renderers(client: redis.Redis) -> None:
    """Load the tokenizer of every registered backend before a job needs it: the first job of a
    worker would otherwise wait for each tokenizer to load."""
    from rollout_service.runtime.tokens import renderer_for
    from rollout_service.state.backends import BackendPool

    for tokenizer in {b.tokenizer for b in BackendPool(client).list() if b.tokenizer}:
        try:
            renderer_for(tokenizer)
        except Exception as exc:  # the job that needs it reports the problem
            log.debug("tokenizer %s not loaded ahead: %s", tokenizer, exc)


@worker_ready.connect
def _announce_queues(sender: object, **_: object) -> None:
    """Keep ``rollout:worker:<host>`` alive while this worker consumes, so /readyz can tell
    (workers/dispatch.py reads it); keep the consumer's prefetch window for the run slots; an init
    or run worker loads the tokenizers of registered backends before its first job needs them; a
    green worker collects cyclic garbage when idle (``collect_when_idle``)."""
    global consumer_qos
    consumer_qos = getattr(sender, "qos", None)
    queues = ",".join(q.name for q in sender.task_consumer.queues)  # type: ignore[attr-defined]
    hostname = sender.hostname  # type: ignore[attr-defined]
    client = redis.Redis.from_url(resolve_redis_url(get_settings()))

    def beat() -> None:
        while True:
            try:
                client.set(f"{HEARTBEAT_KEY_PREFIX}{hostname}", queues, ex=HEARTBEAT_INTERVAL_S * 3)
            except redis.RedisError:
                pass
            time.sleep(HEARTBEAT_INTERVAL_S)

    def warm() -> None:
        while True:
            try:
                warm_renderers(client)
            except redis.RedisError:
                pass
            time.sleep(WARM_INTERVAL_S)

    if {"init", "run"} & set(queues.split(",")):
        threading.Thread(target=warm, name="renderer-warmer", daemon=True).start()
    collect_when_idle(lambda: not worker_state.active_requests, get_settings().gc_max_interval_s, GC_CHECK_S)

    threading.Thread(target=beat, name="queue-heartbeat", daemon=True).start()


@worker_process_init.connect
def _warm_grading_sandboxes(**_: object) -> None:
    """An eval child (prefork) starts its sandbox fork server while it idles, in the background, not
    in its first grading, where the jobs would wait for it."""
    from rollout_service.sandbox.bwrap import warm_fork_server

    def warm() -> None:
        try:
            warm_fork_server()
        except Exception as exc:  # the first grading starts it again and reports what is wrong
            log.warning("could not start the sandbox fork server ahead: %s", exc)

    threading.Thread(target=warm, name="fork-server-warmer", daemon=True).start()
