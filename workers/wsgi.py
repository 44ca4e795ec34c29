"""What gunicorn serves: ``gunicorn 'workers.wsgi:create_app()'``, the gateway enqueueing through
workers.dispatch."""

from __future__ import annotations

from flask import Flask

from rollout_service.gateway.app import create_app as create_gateway
from rollout_service.settings import Settings
from workers import dispatch


def create_app(settings: Settings | None = None) -> Flask:
    return create_gateway(settings, enqueue=dispatch)
