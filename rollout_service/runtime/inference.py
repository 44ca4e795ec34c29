"""Clients for the inference servers' own token APIs: token ids in, token ids + logprobs out.

- vLLM: ``POST /inference/v1/generate`` (vLLM's token-in/token-out route, served with
  ``--enable-scale-out``): ``token_ids`` in, ``choices[0].token_ids`` and
  ``choices[0].logprobs.content[i].logprob`` out (``logprobs: 0``, the sampled token's). A server
  without it answers 404 (403 when started without ``--enable-scale-out``); from then on that URL
  gets ``POST /v1/completions`` with ``prompt`` as a
  list of ids, ``return_token_ids`` and ``return_tokens_as_token_ids`` (``"token_id:N"`` strings
  in ``logprobs.tokens``, what older servers give). A process learns it once per URL: its first
  call asks the token route, and calls made while that answer is pending use ``/v1/completions``,
  so no call waits for the probe.
- SGLang: ``POST /generate`` with ``input_ids`` and ``return_logprob``; ids and logprobs come
  from ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]`` triples.

Every sampling parameter is sent explicitly (a server's generation-config defaults never apply).
Ids and logprobs are kept exactly as the server returned them. Connection failures are
retried against the same server (``settings.llm_connect_retries``), then raised as
``BackendUnreachable`` so the caller can fail over; everything else a server does wrong is
a ``BackendError`` naming the server.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson

from rollout_service.errors import (
    BackendError,
    BackendRejected,
    BackendTimeout,
    BackendUnreachable,
    ContextWindowExceeded,
    GenerationAborted,
    UnknownName,
)
from rollout_service.runtime.http_pool import Abort, Aborted, ConnectFailed, ReadTimedOut, Transport, shared_pool
from rollout_service.schemas import Sampling
from rollout_service.settings import get_settings

FINISH_REASONS = ("stop", "length")
CONNECT_TIMEOUT_S = 10.0
RETRY_BACKOFF_S = 0.1
TOKEN_ID_PREFIX = "token_id:"
_RETRYABLE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    latency_s: float


class InferenceClient(Protocol):
    kind: str
    url: str
    model: str

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        max_new_tokens: int,
        timeout_s: float,
        abort: Abort | None = None,
    ) -> Generation: ...


class HttpxTransport:
    """A ``Transport`` over an ``httpx.Client`` (e.g. one with a mock transport, in tests)."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def post_json(
        self, url: str, body: bytes, timeout_s: float, connect_timeout_s: float, abort: Abort | None = None
    ) -> tuple[int, bytes]:
        if abort is not None and abort.requested:
            raise Aborted("aborted before it was sent")
        try:
            response = self.client.post(
                url,
                content=body,
                headers={"Content-Type": "application/json"},
                timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            )
        except _RETRYABLE as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise ReadTimedOut(str(exc)) from exc
        except httpx.HTTPError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        return response.status_code, response.content


def dumps_body(body: dict[str, Any]) -> bytes:
    """A request body as compact JSON: orjson (much faster on long id lists), or the standard
    library for what orjson refuses (keys that are not strings, integers beyond 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, separators=(",", ":")).encode()


def loads_answer(content: bytes) -> Any:
    """A server's answer: orjson (faster; floats read exactly as the standard library reads
    them), or the standard library for what only it accepts (NaN, Infinity)."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return json.loads(content)


# How vLLM ("This model's maximum context length is N tokens. However, ...", "... is too long and
# exceeds limit of N", "The decoder prompt (length N) is longer than the maximum model length of M"),
# SGLang ("The input (N tokens) is longer than the model's context length")
# and OpenAI-compatible servers refuse a prompt that no longer fits.
_CONTEXT_FULL = re.compile(
    r"maximum context length|context (length|window)|(prompt|input).{0,60}"
    r"(too long|exceeds|longer than the maximum)",
    re.IGNORECASE,
)


def _server_message(content: bytes) -> str:
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode(errors="replace").strip()[:500] or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and set(map(type, value)) <= {int}:  # type() in C: no bools, no subclasses
        return value
    return None


def _float_list(value: Any) -> list[float] | None:
    if not isinstance(value, list):
        return None
    kinds = set(map(type, value))
    if kinds <= {float}:  # what json.loads gives for logprobs: the list as it is
        return value
    if kinds <= {int, float}:
        return [float(v) for v in value]
    return None


class _HTTPInferenceClient:
    kind = "?"
    path = "/"

    def __init__(
        self,
        url: str,
        model: str,
        http: httpx.Client | Transport | None = None,
        connect_retries: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.http: Transport = HttpxTransport(http) if isinstance(http, httpx.Client) else (http or shared_pool())
        self.connect_retries = get_settings().llm_connect_retries if connect_retries is None else connect_retries

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, model={self.model!r})"

    def request_body(self, prompt_ids: list[int], sampling: Sampling, max_new_tokens: int) -> dict[str, Any]:
        raise NotImplementedError

    def parse_response(self, payload: Any) -> tuple[list[int], list[float], str]:
        raise NotImplementedError

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        max_new_tokens: int,
        timeout_s: float,
        abort: Abort | None = None,
    ) -> Generation:
        """``abort``: a handle that ends the request at once from elsewhere (``Aborted`` is raised)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        started = time.monotonic()
        token_ids, logprobs, finish_reason = self._exchange(prompt_ids, sampling, max_new_tokens, timeout_s, abort)
        return Generation(token_ids, logprobs, finish_reason, time.monotonic() - started)

    def _exchange(
        self, prompt_ids: list[int], sampling: Sampling, max_new_tokens: int, timeout_s: float, abort: Abort | None
    ) -> tuple[list[int], list[float], str]:
        """One request and its parsed answer: (token ids, logprobs, finish reason)."""
        body = self.request_body(list(prompt_ids), sampling, max_new_tokens)
        return self.parse_response(self._answer(self.path, *self._send(self.path, body, timeout_s, abort)))

    def _send(self, path: str, body: dict[str, Any], timeout_s: float, abort: Abort | None = None) -> tuple[int, bytes]:
        endpoint = self.url + path
        payload = dumps_body(body)
        attempts = 1 + max(0, self.connect_retries)
        connect_timeout_s = min(timeout_s, CONNECT_TIMEOUT_S)
        for attempt in range(attempts):
            try:
                return self.http.post_json(endpoint, payload, timeout_s, connect_timeout_s, abort)
            except ConnectFailed as exc:
                if attempt + 1 == attempts:
                    raise BackendUnreachable(
                        f"cannot reach the {self.kind} backend at {self.url} after {attempts} "
                        f"attempt(s) ({exc}); check that the server is "
                        f"running and the url is right (GET {self.url}/health should answer)"
                    ) from exc
                time.sleep(RETRY_BACKOFF_S * 2**attempt)
            except ReadTimedOut as exc:
                raise BackendTimeout(
                    f"the {self.kind} backend at {self.url} did not answer within {timeout_s:g} s; "
                    "raise timeouts.llm_call_s (ROLLOUT_LLM_CALL_TIMEOUT_S) or lower "
                    "sampling.max_new_tokens"
                ) from exc
        raise AssertionError("unreachable")

    def _answer(self, path: str, status: int, content: bytes) -> Any:
        if not 200 <= status < 300:
            hint = ""
            if status in (404, 405):
                hint = (
                    f" (is {self.url} really a {self.kind} server? vLLM serves /v1/completions "
                    "(and /inference/v1/generate with --enable-scale-out), SGLang serves /generate: "
                    "register the backend with the right kind)"
                )
            message = _server_message(content)
            rejected = (
                ContextWindowExceeded if status in (400, 413) and _CONTEXT_FULL.search(message) else BackendRejected
            )
            raise rejected(
                f"the {self.kind} backend at {self.url} answered {status} to POST {path}: {message}{hint}",
                status=status,
            )
        try:
            return loads_answer(content)
        except ValueError as exc:
            raise self._malformed(f"the body is not JSON: {content[:200]!r}", path) from exc

    def _malformed(self, problem: str, path: str | None = None) -> BackendError:
        return BackendError(
            f"malformed answer from the {self.kind} backend at {self.url} to POST {path or self.path}: {problem}"
        )

    def _checked(
        self, token_ids: list[int], logprobs: list[float], finish_reason: Any
    ) -> tuple[list[int], list[float], str]:
        if len(token_ids) != len(logprobs):
            raise self._malformed(f"{len(token_ids)} token ids but {len(logprobs)} logprobs; they must align")
        if finish_reason == "abort":
            raise GenerationAborted(
                f"the {self.kind} backend at {self.url} ended the generation with finish reason "
                "'abort' (a pause with mode=abort); it is made again once the service resumes"
            )
        if finish_reason not in FINISH_REASONS:
            raise BackendError(
                f"the {self.kind} backend at {self.url} ended the generation with finish reason "
                f"{finish_reason!r} (expected one of {', '.join(FINISH_REASONS)}); the request "
                "was probably aborted by the server, retry it or check the server's log"
            )
        return token_ids, logprobs, finish_reason


GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
_NO_TOKEN_ROUTE = (403, 404, 405)  # 403: "Scale-out endpoints are disabled" (no --enable-scale-out)
_PROBING, _GENERATE, _COMPLETIONS = "probing", "generate", "completions"
_vllm_routes: dict[str, str] = {}  # url -> the route its calls take (_PROBING: its first call's answer is pending)


def vllm_sampling(sampling: Sampling, max_new_tokens: int) -> dict[str, Any]:
    """vLLM's sampling parameters for one call, the same on both routes."""
    params: dict[str, Any] = {
        "max_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "min_tokens": min(sampling.min_tokens, max_new_tokens),
        "ignore_eos": sampling.ignore_eos,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if sampling.logit_bias:
        params["logit_bias"] = sampling.logit_bias
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    return params


class VLLMClient(_HTTPInferenceClient):
    kind = "vllm"
    path = GENERATE_PATH
    token_route = True  # ask /inference/v1/generate first

    def _exchange(
        self, prompt_ids: list[int], sampling: Sampling, max_new_tokens: int, timeout_s: float, abort: Abort | None
    ) -> tuple[list[int], list[float], str]:
        params = vllm_sampling(sampling, max_new_tokens)
        route = _vllm_routes.get(self.url) if self.token_route else _COMPLETIONS
        if route is None or route == _GENERATE:
            if route is None:
                _vllm_routes[self.url] = _PROBING
            try:
                status, content = self._send(GENERATE_PATH, self.generate_body(prompt_ids, params), timeout_s, abort)
            except BaseException:
                if route is None:
                    _vllm_routes.pop(self.url, None)
                raise
            if status not in _NO_TOKEN_ROUTE or route == _GENERATE:
                _vllm_routes[self.url] = _GENERATE
                return self.parse_generate(self._answer(GENERATE_PATH, status, content))
            _vllm_routes[self.url] = _COMPLETIONS
        return self.parse_response(
            self._answer(
                COMPLETIONS_PATH,
                *self._send(COMPLETIONS_PATH, self.completions_body(prompt_ids, params), timeout_s, abort),
            )
        )

    def generate_body(self, prompt_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        params["detokenize"] = False
        return {"model": self.model, "token_ids": list(prompt_ids), "sampling_params": params, "stream": False}

    def completions_body(self, prompt_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        params.pop("detokenize", None)
        return {
            "model": self.model,
            "prompt": list(prompt_ids),
            **params,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "n": 1,
            "stream": False,
        }

    def request_body(self, prompt_ids: list[int], sampling: Sampling, max_new_tokens: int) -> dict[str, Any]:
        """The ``/v1/completions`` body."""
        return self.completions_body(prompt_ids, vllm_sampling(sampling, max_new_tokens))

    def parse_generate(self, payload: Any) -> tuple[list[int], list[float], str]:
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._malformed("no choices[0]", GENERATE_PATH)
        choice = choices[0]
        token_ids = _int_list(choice.get("token_ids"))
        if token_ids is None:
            raise self._malformed("choices[0].token_ids is not a list of integers", GENERATE_PATH)
        logprobs_block = choice.get("logprobs")
        content = logprobs_block.get("content") if isinstance(logprobs_block, dict) else None
        if not isinstance(content, list):
            raise self._malformed(
                "choices[0].logprobs.content is missing; the server ignored `sampling_params.logprobs: 0`",
                GENERATE_PATH,
            )
        try:
            ids = [entry["token_id"] for entry in content]
            logprobs = _float_list([entry["logprob"] for entry in content])
        except (TypeError, KeyError):
            raise self._malformed(
                "choices[0].logprobs.content holds an entry without token_id and logprob", GENERATE_PATH
            ) from None
        if logprobs is None:
            raise self._malformed("choices[0].logprobs.content[].logprob is not a number", GENERATE_PATH)
        if ids != token_ids:
            raise self._malformed(
                "choices[0].token_ids and the token ids of choices[0].logprobs.content disagree", GENERATE_PATH
            )
        return self._checked(token_ids, logprobs, choice.get("finish_reason"))

    def parse_response(self, payload: Any) -> tuple[list[int], list[float], str]:
        """A ``/v1/completions`` answer."""
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._malformed("no choices[0]", COMPLETIONS_PATH)
        choice = choices[0]
        logprobs_block = choice.get("logprobs")
        if not isinstance(logprobs_block, dict):
            raise self._malformed(
                "choices[0].logprobs is missing; the server ignored `logprobs: 0` "
                "(is it really vLLM's OpenAI-compatible server?)",
                COMPLETIONS_PATH,
            )
        logprobs = _float_list(logprobs_block.get("token_logprobs"))
        if logprobs is None:
            raise self._malformed("choices[0].logprobs.token_logprobs is not a list of numbers", COMPLETIONS_PATH)
        tokens, token_ids = logprobs_block.get("tokens"), choice.get("token_ids")
        given_ids = _int_list(token_ids)
        if (
            given_ids is not None
            and isinstance(tokens, list)
            and tokens == [f"{TOKEN_ID_PREFIX}{i}" for i in given_ids]
        ):  # both given and agreeing: the common case
            return self._checked(list(given_ids), logprobs, choice.get("finish_reason"))
        ids_from_tokens = self._ids_from_token_strings(tokens)
        if token_ids is None:
            if ids_from_tokens is None:
                raise self._malformed(
                    "neither choices[0].token_ids nor 'token_id:N' strings in "
                    "choices[0].logprobs.tokens; use vLLM >= 0.10.2 (return_token_ids) or a "
                    "version that supports return_tokens_as_token_ids",
                    COMPLETIONS_PATH,
                )
            token_ids = ids_from_tokens
        elif _int_list(token_ids) is None:
            raise self._malformed("choices[0].token_ids is not a list of integers", COMPLETIONS_PATH)
        elif ids_from_tokens is not None and ids_from_tokens != token_ids:
            raise self._malformed(
                "choices[0].token_ids and the 'token_id:N' strings of choices[0].logprobs.tokens disagree",
                COMPLETIONS_PATH,
            )
        return self._checked(list(token_ids), logprobs, choice.get("finish_reason"))

    @staticmethod
    def _ids_from_token_strings(tokens: Any) -> list[int] | None:
        if not isinstance(tokens, list):
            return None
        ids = []
        for token in tokens:
            if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
                return None
            try:
                ids.append(int(token[len(TOKEN_ID_PREFIX) :]))
            except ValueError:
                return None
        return ids


class SGLangClient(_HTTPInferenceClient):
    kind = "sglang"
    path = "/generate"

    def request_body(self, prompt_ids: list[int], sampling: Sampling, max_new_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "repetition_penalty": sampling.repetition_penalty,
            "min_new_tokens": min(sampling.min_tokens, max_new_tokens),
            "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": list(sampling.stop_token_ids),
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        }
        if sampling.logit_bias:
            params["logit_bias"] = sampling.logit_bias
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        return {
            "input_ids": prompt_ids,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }

    def parse_response(self, payload: Any) -> tuple[list[int], list[float], str]:
        meta = payload.get("meta_info") if isinstance(payload, dict) else None
        if not isinstance(meta, dict):
            raise self._malformed("no meta_info object")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise self._malformed(
                "meta_info.output_token_logprobs is missing; the server ignored "
                "`return_logprob: true` (is it really SGLang?)"
            )
        token_ids: list[int] = []
        logprobs: list[float] = []
        for triple in triples:
            if (
                not isinstance(triple, (list, tuple))
                or len(triple) < 2
                or _float_list([triple[0]]) is None
                or _int_list([triple[1]]) is None
            ):
                raise self._malformed(
                    f"meta_info.output_token_logprobs holds {triple!r}, expected [logprob, token_id, text]"
                )
            logprobs.append(float(triple[0]))
            token_ids.append(triple[1])
        finish = meta.get("finish_reason")
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        return self._checked(token_ids, logprobs, finish_type)


class ReferenceClient(VLLMClient):
    """The reference server speaks vLLM's ``/v1/completions`` (and SGLang's ``/generate``)."""

    token_route = False


CLIENTS: dict[str, type[_HTTPInferenceClient]] = {
    "vllm": VLLMClient,
    "sglang": SGLangClient,
    "reference": ReferenceClient,
}


def make_client(kind: str, url: str, model: str) -> InferenceClient:
    """A client for a backend of ``kind`` at ``url`` serving ``model`` (pooled connections)."""
    try:
        client_class = CLIENTS[kind]
    except KeyError:
        raise UnknownName("backend kind", kind, CLIENTS) from None
    return client_class(url, model)
