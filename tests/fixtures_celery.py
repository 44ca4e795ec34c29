"""A Celery app configured as a worker's, built in the test process by ``workers.celery_app.create_app``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from celery import Celery

from rollout_service.settings import get_settings


@pytest.fixture
def celery_app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Celery]]:
    """``configure(redis_url, **settings_env)``: from then on this process's settings are those of a
    worker started with ``settings_env`` (ROLLOUT_* variables) on ``redis_url``, and ``workers``
    publishes through a Celery app ``create_app`` built from them, which ``configure`` returns.
    The settings and the app are restored after the test."""
    from workers import celery_app as celery_app_module
    from workers import dispatch

    apps: list[Celery] = []
    with monkeypatch.context() as patch:

        def configure(redis_url: str, **settings_env: str) -> Celery:
            patch.delenv("ROLLOUT_BROKER_URL", raising=False)
            for name, value in {**settings_env, "ROLLOUT_REDIS_URL": redis_url}.items():
                patch.setenv(name, value)
            get_settings.cache_clear()
            app = celery_app_module.create_app(get_settings())
            patch.setattr(celery_app_module, "app", app)
            patch.setattr(dispatch, "app", app)  # bound at import: ``from workers.celery_app import app``
            apps.append(app)
            return app

        yield configure
    get_settings.cache_clear()
    for app in apps:
        app.close()
