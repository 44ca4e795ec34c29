"""What the reference server asks of an engine (``Engine``, ``GenerateParams`` parsed and checked
from a request body, ``Completion``), and the scripted engine.

``ScriptEngine`` replays scripted assistant turns, statelessly::

    {"episodes": [{"match": "<substring of the decoded prompt>",
                   "turns": ["assistant text", {"text": "...", "delay_s": 0.2}, ...]}]}

The episode is the first whose ``match`` occurs in the decoded prompt; the turn is the number of
assistant turns already completed in the prompt. The turn text is tokenized with the tokenizer and
followed by the end-of-turn token; logprobs are ``scripted_logprob(position, token_id)``. A replay
samples nothing: of the sampling parameters only max_tokens, stop_token_ids and ignore_eos apply
(the others are checked and ignored).

An episode may give ``"rotate": [[turns of variant 0], [turns of variant 1], ...]`` instead of
``"turns"``: each new rollout of that prompt (a request with no assistant turn yet) takes the next
variant round-robin, so the n rollouts of a GRPO group can answer differently. Later turns follow
the variant whose earlier turn texts all occur in the prompt, so give the variants distinct first
turns.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from rollout_service.runtime.tokens import ChatRenderer, load_tokenizer


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


NO_CLIENT = ClientWatch(None)  # a request without a socket: its client never leaves


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


class Engine(Protocol):
    """What the reference server's routes use of an engine."""

    name: str
    max_model_len: int

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def generate(self, prompt_ids: list[int], params: GenerateParams, client: ClientWatch = ...) -> Completion: ...

    def update_weights_from_disk(self, model_path: str) -> str: ...


# A request body's fields, checked as vLLM and SGLang check them (a RequestError names the field).


def body_field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RequestError(f"{name!r} must be a {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def token_ids_field(value: Any, name: str) -> list[int]:
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
    value = body_field(body, name, float, default)
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


def generate_params(body: dict[str, Any], max_tokens: int, seed_key: str, min_tokens_key: str) -> GenerateParams:
    params = GenerateParams(
        max_tokens=max_tokens,
        temperature=body_field(body, "temperature", float, 1.0),
        top_p=body_field(body, "top_p", float, 1.0),
        top_k=body_field(body, "top_k", int, -1),
        seed=body_field(body, seed_key, int, None),
        stop_token_ids=token_ids_field(body.get("stop_token_ids") or [], "stop_token_ids"),
        ignore_eos=body_field(body, "ignore_eos", bool, False),
        min_p=_bounded(body, "min_p", 0.0),
        presence_penalty=_bounded(body, "presence_penalty", 0.0),
        frequency_penalty=_bounded(body, "frequency_penalty", 0.0),
        repetition_penalty=_bounded(body, "repetition_penalty", 1.0),
        min_tokens=body_field(body, min_tokens_key, int, 0),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )
    if params.max_tokens < 1:
        raise RequestError(f"the maximum number of new tokens must be >= 1, got {params.max_tokens}")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise RequestError("temperature must be >= 0 and top_p in (0, 1]")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise RequestError(
            f"{min_tokens_key!r} must be in [0, {params.max_tokens}] (the maximum number of new "
            f"tokens), got {params.min_tokens}"
        )
    return params


class ScriptEngine:
    """Replays the assistant turns of a script through the token protocol."""

    name = "scripted"

    def __init__(self, script: dict[str, Any], tokenizer_path: str, max_model_len: int = 1 << 30) -> None:
        self.episodes = _validated_episodes(script)
        self.renderer = ChatRenderer(load_tokenizer(tokenizer_path))
        self.max_model_len = max_model_len
        self._rotations: collections.Counter[str] = collections.Counter()
        self._rotation_lock = threading.Lock()

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.renderer.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def encode(self, text: str) -> list[int]:
        return self.renderer.encode(text)

    def generate(self, prompt_ids: list[int], params: GenerateParams, client: ClientWatch = NO_CLIENT) -> Completion:
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {len(prompt_ids)} tokens; shorten it"
            )
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
        variants: list[Any] = rotate if isinstance(rotate, list) and rotate else [episode.get("turns")]
        if any(not isinstance(turns, list) or not turns for turns in variants):
            raise bad(f'episode {n} needs a non-empty "turns" list (or "rotate": a list of them)')
        episodes.append(
            {"match": episode["match"], "variants": [_validated_turns(turns, n, bad) for turns in variants]}
        )
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
