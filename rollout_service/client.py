"""Trainer-side SDK: submit tasks, wait for jobs, fetch token-level trajectories."""
from __future__ import annotations

import time
from typing import Any, Iterable, Optional

import httpx
import msgpack

from rollout_service.errors import ApiError, DeadlineExceeded
from rollout_service.schemas import (
    TERMINAL_STATUSES, BackendView, JobView, ScoreResponse, SubmitResponse, Trajectory,
)


class RolloutClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8006", token: Optional[str] = None,
                 timeout_s: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- jobs -------------------------------------------------------------------------
    def submit(self, task: dict[str, Any], *, n: int = 1, idempotency_key: Optional[str] = None,
               **fields: Any) -> SubmitResponse:
        """``fields``: sampling, agent, timeouts, metadata, max_policy_lag (as in POST /v1/jobs)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"task": task, "n": n, **{k: v for k, v in fields.items() if v is not None}}
        return SubmitResponse.model_validate(self._call("POST", "/v1/jobs", json=body, headers=headers))

    def get(self, job_id: str) -> JobView:
        return JobView.model_validate(self._call("GET", f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> JobView:
        return JobView.model_validate(self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    def trajectory(self, job_id: str) -> Trajectory:
        return Trajectory.model_validate(self._call("GET", f"/v1/jobs/{job_id}/trajectory", msgpack_body=True))

    def wait(self, job_ids: Iterable[str], timeout_s: float = 600.0, poll_s: float = 0.2,
             on_done: Optional[Any] = None) -> list[JobView]:
        """Poll until every job is terminal; ``on_done(view)`` is called once per finished job."""
        pending = list(dict.fromkeys(job_ids))
        done: dict[str, JobView] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            for job_id in list(pending):
                view = self.get(job_id)
                if view.status in TERMINAL_STATUSES:
                    done[job_id] = view
                    pending.remove(job_id)
                    if on_done:
                        on_done(view)
            if pending:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"{len(pending)} jobs still running after {timeout_s:.0f} s: "
                                           f"{pending[:5]}; wait longer or cancel them")
                time.sleep(poll_s)
        return [done[j] for j in dict.fromkeys(job_ids)]

    def score(self, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse:
        return ScoreResponse.model_validate(self._call("POST", "/v1/score", json={"task": task, "submission": submission}))

    # -- backends ---------------------------------------------------------------------
    def add_backend(self, url: str, kind: str, model: str, tokenizer: Optional[str] = None) -> BackendView:
        body = {"url": url, "kind": kind, "model": model, **({"tokenizer": tokenizer} if tokenizer else {})}
        return BackendView.model_validate(self._call("POST", "/v1/backends", json=body))

    def backends(self) -> list[BackendView]:
        return [BackendView.model_validate(b) for b in self._call("GET", "/v1/backends")["backends"]]

    def remove_backend(self, backend_id: str) -> None:
        self._call("DELETE", f"/v1/backends/{backend_id}")

    def pause(self, wait_s: float = 0.0) -> dict[str, Any]:
        return self._call("POST", "/v1/backends/pause", params={"wait": wait_s})

    def resume(self, policy_version: Optional[int] = None) -> dict[str, Any]:
        body = {} if policy_version is None else {"policy_version": policy_version}
        return self._call("POST", "/v1/backends/resume", json=body)

    # -- plumbing ---------------------------------------------------------------------
    def _call(self, method: str, path: str, msgpack_body: bool = False, **kwargs: Any) -> Any:
        if msgpack_body:
            kwargs.setdefault("headers", {})["Accept"] = "application/msgpack"
        response = self.http.request(method, path, **kwargs)
        if response.headers.get("content-type", "").startswith("application/msgpack"):
            doc = msgpack.unpackb(response.content, raw=False, strict_map_key=False)
        else:
            try:
                doc = response.json()
            except ValueError:
                doc = {"error": {"code": "bad_response", "message": response.text[:500]}}
        if response.status_code >= 400:
            err = doc.get("error", {}) if isinstance(doc, dict) else {}
            raise ApiError(response.status_code, err.get("code", "error"), err.get("message", str(doc)))
        return doc
