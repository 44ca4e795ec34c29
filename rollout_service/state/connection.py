"""Redis connections: the URL, one retrying client per process and URL, the broker's client, scripts
registered once per client, and Redis errors turned into ``StoreUnavailable``."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.utils
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from rollout_service.concurrency.autopipeline import AutoPipelineRedis, ScriptLoadingRedis
from rollout_service.concurrency.green import green_process
from rollout_service.errors import STORE_OUTAGE, ConfigError, StoreUnavailable
from rollout_service.settings import Settings, get_settings

TRANSIENT_REDIS_ERRORS = tuple(e for e in STORE_OUTAGE if e is not StoreUnavailable)
BACKOFF_CAP_S = 1.0


class OutageRetry(Retry):
    """redis-py's retry, ``retries`` times at least and for ``outage_s`` seconds at most after the
    first failure: a restart (connection refused, then LOADING while it reads its AOF) or a Sentinel
    failover (a replica answering READONLY) is waited out where the command was issued."""

    def __init__(self, retries: int, outage_s: float) -> None:
        super().__init__(ExponentialBackoff(cap=BACKOFF_CAP_S, base=0.05), retries, TRANSIENT_REDIS_ERRORS)
        self.outage_s = outage_s

    def call_with_retry(
        self,
        do: Callable[[], Any],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> Any:
        failures, since = 0, 0.0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                since = since or time.monotonic()
                fail(error, failures) if with_failure_count else fail(error)
                if failures > self._retries and time.monotonic() - since >= self.outage_s:
                    raise
                time.sleep(self._backoff.compute(failures))


def _remember_redis_version() -> None:
    """redis-py looks its own version up in its package metadata (an email-format parse, most of what
    a connection costs) every time it makes a connection. The version does not change."""
    if not hasattr(redis.utils.get_lib_version, "cache_info"):
        redis.utils.get_lib_version = functools.lru_cache(maxsize=1)(redis.utils.get_lib_version)


_remember_redis_version()


def resolve_redis_url(settings: Settings) -> str:
    if settings.redis_url:
        return settings.redis_url
    recorded = settings.state_path / "redis.url"
    if recorded.exists():
        return recorded.read_text().strip()
    raise ConfigError(
        "no Redis configured: set ROLLOUT_REDIS_URL=redis://host:port/0, or run "
        "`rollout-service up` (it starts one and records it under ROLLOUT_STATE_DIR)"
    )


class OutagePool(redis.BlockingConnectionPool):
    """A blocking pool whose connecting is retried like a command: redis-py retries a command only
    once the pool gave it a connection, and a Redis that is restarting refuses the connection."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        connect = super().get_connection
        retry = self.connection_kwargs["retry"]
        return retry.call_with_retry(
            lambda: connect(*args, **kwargs), lambda error: None, is_retryable=lambda e: not _pool_exhausted(e)
        )


def _pool_exhausted(error: Exception) -> bool:
    """The pool had no free connection within ``redis_pool_wait_s``: not an outage, not retried."""
    return "No connection available" in str(error)


@functools.lru_cache(maxsize=8)
def _client_for(
    url: str, socket_timeout_s: float, connect_timeout_s: float, retries: int, outage_s: float = 0.0
) -> redis.Redis:
    """One client per process and URL that rides out a Redis restart: deliberate timeouts, every
    command retried ``retries`` times at least, and for ``outage_s``, with exponential backoff on
    connection errors and timeouts (``OutageRetry``).
    Its pool blocks when all connections are busy (hundreds of episodes share a few dozen
    connections) instead of failing with "Too many connections"."""
    settings = get_settings()
    pool = OutagePool.from_url(
        url,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_pool_wait_s,
        health_check_interval=30,
        **({} if url.startswith("unix:") else {"socket_keepalive": True}),  # TCP only
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=OutageRetry(retries, outage_s),
        retry_on_error=list(TRANSIENT_REDIS_ERRORS),
    )
    client = client_class()(connection_pool=pool)
    if isinstance(client, AutoPipelineRedis):
        client.linger_s = settings.redis_batch_linger_ms / 1000
    return client


def client_class() -> type[redis.Redis]:
    """Green worker processes (gevent pools) share round trips across greenlets; others load
    their scripts once."""
    return AutoPipelineRedis if green_process() else ScriptLoadingRedis


def redis_client(settings: Settings | None = None, ride_out_outages: bool = False) -> redis.Redis:
    """This process's client. ``ride_out_outages``: a worker's, whose commands wait out a Redis
    restart (``redis_outage_wait_s``); the gateway's answer 503 after their retries instead (the
    SDK retries it), so that no request hangs on a Redis that is away."""
    settings = settings or get_settings()
    return _client_for(
        resolve_redis_url(settings),
        settings.redis_socket_timeout_s,
        settings.redis_connect_timeout_s,
        settings.redis_retries,
        settings.redis_outage_wait_s if ride_out_outages else 0.0,
    )


def broker_client(state: redis.Redis, settings: Settings | None = None) -> redis.Redis:
    """The Redis holding Celery's queues: ROLLOUT_BROKER_URL's (riding out outages as ``state``
    does), or ``state`` when the broker shares the state's Redis."""
    settings = settings or get_settings()
    if not settings.broker_url:
        return state
    return _client_for(
        settings.broker_url,
        settings.redis_socket_timeout_s,
        settings.redis_connect_timeout_s,
        settings.redis_retries,
        getattr(state.connection_pool.connection_kwargs.get("retry"), "outage_s", 0.0),
    )


_script_sets: dict[tuple[int, tuple[str, ...]], list[Script]] = {}


def scripts_of(client: redis.Redis, *sources: str) -> list[Script]:
    """``client.register_script`` of each source, made once per client and set of sources (a store
    or a backend pool is built per episode; registering hashes and encodes every script again)."""
    known = _script_sets.get((id(client), sources))
    if known is None or known[0].registered_client is not client:
        known = _script_sets[id(client), sources] = [client.register_script(source) for source in sources]
    return known


def call_redis(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a Redis command whose client gave up retrying raising ``StoreUnavailable``."""
    try:
        return fn(*args, **kwargs)
    except TRANSIENT_REDIS_ERRORS as exc:
        raise StoreUnavailable(
            f"Redis is unreachable or not answering ({type(exc).__name__}: {exc}); "
            "check ROLLOUT_REDIS_URL and that Redis runs, then retry"
        ) from exc


def as_text(value: Any) -> str:
    """A Redis reply (bytes) or a plain value as str."""
    return value.decode() if isinstance(value, bytes) else str(value)
