"""Trainer-side SDK: submit tasks, wait for jobs, fetch token-level trajectories."""

from __future__ import annotations

import contextlib
import gc
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx
import msgpack
import orjson

from rollout_service.errors import ApiError, DeadlineExceeded
from rollout_service.schemas import (
    MAX_WAIT_JOBS,
    BackendView,
    BatchCreated,
    BatchGroup,
    BatchGroupsPage,
    BatchView,
    FinishReason,
    JobView,
    ScoreResponse,
    SubmitResponse,
    Trajectory,
    Turn,
)

RETRIED_STATUSES = (502, 503, 504)  # the gateway restarting, or its Redis: the request did nothing
SAFE_POSTS = ("/v1/jobs/wait", "/v1/jobs/trajectories", "/v1/score")  # reads, though POSTed
BACKOFF_CAP_S = 2.0


class RolloutClient:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8006",
        token: str | None = None,
        timeout_s: float = 60.0,
        outage_wait_s: float = 180.0,
    ) -> None:
        """``outage_wait_s``: how long a request that is safe to repeat (a read, a cancel, a submission
        under its Idempotency-Key, which the client adds when none is given) is tried again while the
        gateway or its Redis is away (a connection error, 502, 503, 504; for a submission, a 409 while
        the same key's first request is unfinished or died with its gateway) before the error is raised."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.outage_wait_s = outage_wait_s
        self._control_timeout_s = max(timeout_s, 120.0)  # the service waits for every engine's answer

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- jobs -------------------------------------------------------------------------
    def submit(
        self, task: dict[str, Any], *, n: int = 1, idempotency_key: str | None = None, **fields: Any
    ) -> SubmitResponse:
        """``fields``: sampling, agent, timeouts, metadata, max_policy_lag (as in POST /v1/jobs)."""
        headers = {"Idempotency-Key": idempotency_key or new_idempotency_key()}
        body = {"task": task, "n": n, **{k: v for k, v in fields.items() if v is not None}}
        return SubmitResponse.model_validate(self._call("POST", "/v1/jobs", json=body, headers=headers))

    def get(self, job_id: str) -> JobView:
        return JobView.model_validate(self._call("GET", f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> JobView:
        return JobView.model_validate(self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    def trajectory(self, job_id: str) -> Trajectory:
        return Trajectory.model_validate(self._call("GET", f"/v1/jobs/{job_id}/trajectory", msgpack_body=True))

    def submit_many(self, jobs: list[dict[str, Any]], idempotency_key: str | None = None) -> list[SubmitResponse]:
        """Submit many job bodies (as POST /v1/jobs takes them) in one request; answers in order."""
        headers = {"Idempotency-Key": idempotency_key or new_idempotency_key()}
        doc = self._call("POST", "/v1/jobs/bulk", json={"jobs": jobs}, headers=headers)
        return [SubmitResponse.model_validate(s) for s in doc["submissions"]]

    def wait(
        self,
        job_ids: Iterable[str],
        timeout_s: float = 600.0,
        poll_s: float | None = None,
        on_done: Callable[[JobView], Any] | None = None,
        long_poll_s: float = 30.0,
    ) -> list[JobView]:
        """Long-poll POST /v1/jobs/wait until every job is terminal; ``on_done(view)`` is called
        once per finished job as it ends. ``poll_s`` is accepted for compatibility and unused."""
        order = list(dict.fromkeys(job_ids))
        pending = list(order)
        done: dict[str, JobView] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(
                    f"{len(pending)} jobs still running after {timeout_s:.0f} s: "
                    f"{pending[:5]}; wait longer or cancel them"
                )
            wait_s = min(left, long_poll_s)
            doc = self._call(
                "POST",
                "/v1/jobs/wait",
                timeout=wait_s + 60,
                json={"job_ids": pending[:MAX_WAIT_JOBS], "timeout_s": wait_s, "min_finished": 1},
            )
            for raw in doc["finished"]:
                view = JobView.model_validate(raw)
                done[view.job_id] = view
                if on_done:
                    on_done(view)
            pending = [j for j in pending if j not in done]
        return [done[j] for j in order]

    def trajectories(self, job_ids: Iterable[str], chunk: int = 1000) -> dict[str, Trajectory]:
        """Trajectories of many jobs, ``chunk`` per request, msgpack on the wire; jobs without a
        trajectory (yet) are left out."""
        ids = list(dict.fromkeys(job_ids))
        found: dict[str, Trajectory] = {}
        for start in range(0, len(ids), chunk):
            with collector_paused():  # millions of ids and logprobs: a full collection would walk them all
                doc = self._call(
                    "POST", "/v1/jobs/trajectories", msgpack_body=True, json={"job_ids": ids[start : start + chunk]}
                )
                for job_id, raw in doc["trajectories"].items():
                    if raw is not None:
                        found[job_id] = stored_trajectory(raw)
        return found

    def list_jobs(
        self,
        status: str | None = None,
        group_id: str | None = None,
        batch_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> tuple[list[JobView], str | None]:
        """One page of GET /v1/jobs, newest first: (views, cursor of the next page or None)."""
        params = {
            k: v
            for k, v in {
                "status": status,
                "group_id": group_id,
                "batch_id": batch_id,
                "limit": limit,
                "cursor": cursor,
            }.items()
            if v is not None
        }
        doc = self._call("GET", "/v1/jobs", params=params)
        return [JobView.model_validate(v) for v in doc["jobs"]], doc["cursor"]

    def score(self, task: dict[str, Any], submission: dict[str, Any], timeout_s: float = 1900.0) -> ScoreResponse:
        """Grade ``submission``; waits as long as the gateway does (a SWE image's tests may take the
        harness's 1800 s)."""
        return ScoreResponse.model_validate(
            self._call("POST", "/v1/score", json={"task": task, "submission": submission}, timeout=timeout_s)
        )

    # -- backends ---------------------------------------------------------------------
    def add_backend(self, url: str, kind: str, model: str, tokenizer: str | None = None) -> BackendView:
        body = {"url": url, "kind": kind, "model": model, **({"tokenizer": tokenizer} if tokenizer else {})}
        return BackendView.model_validate(self._call("POST", "/v1/backends", json=body))

    def backends(self) -> list[BackendView]:
        return [BackendView.model_validate(b) for b in self._call("GET", "/v1/backends")["backends"]]

    def remove_backend(self, backend_id: str) -> None:
        self._call("DELETE", f"/v1/backends/{backend_id}")

    def pause(self, wait_s: float = 0.0, ttl_s: float | None = None, mode: str | None = None) -> dict[str, Any]:
        """Stop new LLM calls and pause every engine for a weight sync. ``mode``: ``"wait"`` (the
        server's default) lets calls in flight finish, ``"keep"`` freezes them in the engines until
        resume, ``"abort"`` drops them. The pause lifts by itself after ``ttl_s`` (server default
        600 s) unless renewed by pausing again, or ended by resume(). The answer's ``engines`` says
        what each engine answered."""
        params: dict[str, Any] = {"wait": wait_s}
        if ttl_s is not None:
            params["ttl"] = ttl_s
        if mode is not None:
            params["mode"] = mode
        return self._call("POST", "/v1/backends/pause", params=params, timeout=wait_s + self._control_timeout_s)

    def resume(self, policy_version: int | None = None) -> dict[str, Any]:
        body = {} if policy_version is None else {"policy_version": policy_version}
        return self._call("POST", "/v1/backends/resume", json=body, timeout=self._control_timeout_s)

    def update_weights(
        self, model_path: str, model: str | None = None, policy_version: int | None = None, timeout_s: float = 900.0
    ) -> dict[str, Any]:
        """Every engine of ``model`` (default: the only model served) loads the weights saved in
        ``model_path`` (``save_pretrained``; a directory the engines can read); answers once all
        did. An engine that failed is an ApiError (502) naming it; the policy version then stays."""
        body = {
            "model_path": str(model_path),
            **({"model": model} if model else {}),
            **({} if policy_version is None else {"policy_version": policy_version}),
        }
        return self._call("POST", "/v1/backends/update_weights", json=body, timeout=timeout_s)

    # -- batches --------------------------------------------------------------------
    def batch(
        self,
        tasks: list[dict[str, Any]],
        *,
        group_size: int,
        target_groups: int,
        max_inflight_groups: int | None = None,
        filter: str = "none",
        on_failure: str = "drop_group",
        max_rollout_retries: int | None = None,
        trajectories: bool = True,
        progress: bool = True,
        wait_s: float = 10.0,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> BatchRun:
        """Submit a batch (POST /v1/batches); iterate the result for its accepted groups as they come.

        ``filter="nonuniform_reward"`` keeps only groups whose rewards differ (DAPO dynamic
        sampling). ``fields``: sampling, agent, timeouts, metadata, max_policy_lag.
        """
        body = {
            "tasks": tasks,
            "group_size": group_size,
            "target_groups": target_groups,
            "max_inflight_groups": max_inflight_groups,
            "filter": filter,
            "on_failure": on_failure,
            "max_rollout_retries": max_rollout_retries,
            **fields,
        }
        headers = {"Idempotency-Key": idempotency_key or new_idempotency_key()}
        created = BatchCreated.model_validate(
            self._call("POST", "/v1/batches", json={k: v for k, v in body.items() if v is not None}, headers=headers)
        )
        return BatchRun(
            self,
            created.batch_id,
            target_groups,
            trajectories=trajectories,
            progress=progress,
            wait_s=wait_s,
            timeout_s=timeout_s,
        )

    def batch_status(self, batch_id: str) -> BatchView:
        return BatchView.model_validate(self._call("GET", f"/v1/batches/{batch_id}"))

    def batch_groups(self, batch_id: str, after: str = "0", wait_s: float = 0.0) -> BatchGroupsPage:
        """One long-poll: accepted groups after ``after`` (a cursor from the previous page)."""
        return BatchGroupsPage.model_validate(
            self._call(
                "GET",
                f"/v1/batches/{batch_id}/groups",
                params={"after": after, "wait": wait_s},
                timeout=wait_s + self.http.timeout.read if self.http.timeout.read else None,
            )
        )

    def cancel_batch(self, batch_id: str) -> BatchView:
        return BatchView.model_validate(self._call("POST", f"/v1/batches/{batch_id}/cancel"))

    # -- plumbing ---------------------------------------------------------------------
    def _call(self, method: str, path: str, msgpack_body: bool = False, **kwargs: Any) -> Any:
        if msgpack_body:
            kwargs.setdefault("headers", {})["Accept"] = "application/msgpack"
        keyed = "Idempotency-Key" in kwargs.get("headers", {})
        safe = keyed or method in ("GET", "DELETE") or path in SAFE_POSTS or path.endswith("/cancel")
        retried = (*RETRIED_STATUSES, 409) if keyed else RETRIED_STATUSES
        give_up_at, tries = time.monotonic() + (self.outage_wait_s if safe else 0.0), 0
        while True:
            tries += 1
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError:
                if time.monotonic() >= give_up_at:
                    raise
            else:
                if response.status_code not in retried or time.monotonic() >= give_up_at:
                    return self._answer(response)
            time.sleep(min(0.1 * 2**tries, BACKOFF_CAP_S))

    @staticmethod
    def _answer(response: httpx.Response) -> Any:
        if response.headers.get("content-type", "").startswith("application/msgpack"):
            doc = msgpack.unpackb(response.content, raw=False, strict_map_key=False)
        else:
            try:
                doc = orjson.loads(response.content)
            except ValueError:
                doc = {"error": {"code": "bad_response", "message": response.text[:500]}}
        if response.status_code >= 400:
            err = doc.get("error", {}) if isinstance(doc, dict) else {}
            raise ApiError(response.status_code, err.get("code", "error"), err.get("message", str(doc)))
        return doc


def new_idempotency_key() -> str:
    """A submission's key, so that the client may send it again after an outage without a duplicate."""
    return f"sdk-{uuid.uuid4().hex}"


class BatchRun:
    """A submitted batch. Iterating it yields accepted groups (with trajectories, rewards and
    group mean/std for advantages) until the batch is over, with a tqdm progress bar.

    ``view()`` has the counters and, once over, ``remaining_tasks`` to carry over; leaving a
    ``with`` block cancels the batch if it is still running.
    """

    def __init__(
        self,
        client: RolloutClient,
        batch_id: str,
        target_groups: int,
        *,
        trajectories: bool = True,
        progress: bool = True,
        wait_s: float = 10.0,
        timeout_s: float | None = None,
    ) -> None:
        self.client = client
        self.batch_id = batch_id
        self.target_groups = target_groups
        self.trajectories = trajectories
        self.progress = progress
        self.wait_s = wait_s
        self.timeout_s = timeout_s

    def __iter__(self) -> Iterator[BatchGroup]:
        from tqdm import tqdm

        deadline = time.monotonic() + self.timeout_s if self.timeout_s else None
        cursor = "0"
        with tqdm(total=self.target_groups, desc=self.batch_id, unit="group", disable=not self.progress) as bar:
            while True:
                page = self.client.batch_groups(self.batch_id, after=cursor, wait_s=self.wait_s)
                cursor = page.cursor
                bar.set_postfix(dropped=page.dropped, in_flight=page.in_flight, refresh=False)
                for group in page.groups:
                    if self.trajectories:
                        found = self.client.trajectories([r.job_id for r in group.rollouts])
                        for rollout in group.rollouts:
                            rollout.trajectory = found.get(rollout.job_id)
                    bar.update(1)
                    yield group
                if page.done:
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"batch {self.batch_id} still running after {self.timeout_s:.0f} s "
                        f"({page.accepted}/{self.target_groups} accepted); wait longer or cancel it"
                    )

    def groups(self) -> list[BatchGroup]:
        return list(self)

    def view(self) -> BatchView:
        return self.client.batch_status(self.batch_id)

    def cancel(self) -> BatchView:
        return self.client.cancel_batch(self.batch_id)

    def __enter__(self) -> BatchRun:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.view().status.value == "running":
            self.cancel()


def stored_trajectory(doc: dict[str, Any]) -> Trajectory:
    """A trajectory document as the service stored it (validated when it was written): only the
    few turns are validated again, not the token lists, which can hold millions of numbers."""
    fields = dict(doc)
    fields["turns"] = [Turn.model_validate(t) for t in doc.get("turns", [])]
    if fields.get("finish_reason") is not None:
        fields["finish_reason"] = FinishReason(fields["finish_reason"])
    return Trajectory.model_construct(**fields)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off while a large document is decoded: it allocates nothing
    cyclic, and each full collection meanwhile walks every list of ids and logprobs built so far,
    which makes decoding a large batch of trajectories superlinear."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
