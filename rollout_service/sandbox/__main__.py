"""``python -m rollout_service.sandbox reap``: kill this host's sandboxes that outlived their expiry."""
from __future__ import annotations

import argparse
import socket

from rollout_service.errors import ConfigError
from rollout_service.sandbox.registry import reap_expired
from rollout_service.settings import get_settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout_service.sandbox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    reap = sub.add_parser("reap", help="kill expired sandboxes of this host and unregister them")
    reap.add_argument("--redis-url", default=get_settings().redis_url, help="default: ROLLOUT_REDIS_URL")
    reap.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    if not args.redis_url:
        raise ConfigError("no Redis to read the sandbox registry from: pass --redis-url or set ROLLOUT_REDIS_URL")
    import redis

    client = redis.Redis.from_url(args.redis_url)
    for sandbox_id in reap_expired(client, args.host):
        print(f"reaped {sandbox_id}")


if __name__ == "__main__":
    main()
