"""Redis connections: the URL, one retrying client per process and URL, the broker's client, scripts
registered once per client, and Redis errors turned into ``StoreUnavailable``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import redis
import redis.utils
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from rollout_service.concurrency.autopipeline import AutoPipelineRedis, ScriptLoadingRedis
from rollout_service.concurrency.green import green_process
from rollout_service.errors import ConfigError, StoreUnavailable
from rollout_service.settings import Settings, get_settings

TRANSIENT_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


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


@functools.lru_cache(maxsize=8)
def _client_for(url: str, socket_timeout_s: float, connect_timeout_s: float, retries: int) -> redis.Redis:
    """One client per process and URL that rides out a Redis blip: deliberate timeouts, every
    command retried ``retries`` times with exponential backoff on connection errors and timeouts.
    Its pool blocks when all connections are busy (hundreds of episodes share a few dozen
    connections) instead of failing with "Too many connections"."""
    settings = get_settings()
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_pool_wait_s,
        health_check_interval=30,
        **({} if url.startswith("unix:") else {"socket_keepalive": True}),  # TCP only
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
    client = client_class()(connection_pool=pool)
    if isinstance(client, AutoPipelineRedis):
        client.linger_s = settings.redis_batch_linger_ms / 1000
    return client


def client_class() -> type[redis.Redis]:
    """Green worker processes (gevent pools) share round trips across greenlets; others load
    their scripts once."""
    return AutoPipelineRedis if green_process() else ScriptLoadingRedis


def redis_client(settings: Settings | None = None) -> redis.Redis:
    settings = settings or get_settings()
    return _client_for(
        resolve_redis_url(settings),
        settings.redis_socket_timeout_s,
        settings.redis_connect_timeout_s,
        settings.redis_retries,
    )


def broker_client(state: redis.Redis, settings: Settings | None = None) -> redis.Redis:
    """The Redis holding Celery's queues: ROLLOUT_BROKER_URL's, or ``state`` when the broker
    shares the state's Redis."""
    settings = settings or get_settings()
    if not settings.broker_url:
        return state
    return _client_for(
        settings.broker_url, settings.redis_socket_timeout_s, settings.redis_connect_timeout_s, settings.redis_retries
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
