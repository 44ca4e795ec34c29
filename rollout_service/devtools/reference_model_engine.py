"""The reference server's model engine: a Hugging Face causal LM on CPU.

Concurrent requests are generated together as one padded batch (see ``ModelEngine``). Sampling
honours every parameter the service forwards, as vLLM applies them: logit_bias and min_tokens (no
eos or stop token before it), then repetition_penalty (over prompt and output), presence_penalty
and frequency_penalty (output), temperature (greedy at 0), top_k, top_p, min_p, and seed; each
logprob is the log-softmax of the raw logits at that position (vLLM's default "raw" logprobs, before
penalties, temperature and filtering); generation stops at an eos or stop token, which is included
in the output.
"""

from __future__ import annotations

import collections
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_service.devtools.reference_engines import (
    NO_CLIENT,
    ClientGone,
    ClientWatch,
    Completion,
    GenerateParams,
    RequestError,
)
from rollout_service.runtime.tokens import load_tokenizer


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: GenerateParams
    abandoned: bool = False  # its client left: dropped from its batch
    done: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    error: BaseException | None = None

    def is_abandoned(self) -> bool:
        return self.abandoned


class _Row:
    """One request of a running batch: its sampler state and what it generated so far."""

    def __init__(
        self, torch: Any, prompt_ids: list[int], params: GenerateParams, max_tokens: int, stops: set[int]
    ) -> None:
        self.params = params
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.stops = stops
        self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[dict[int, float]] = []
        self.finish: str = "length"
        self.stop_token: int | None = None

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
        if not (
            params.logit_bias
            or len(self.ids) < params.min_tokens
            or params.repetition_penalty != 1.0
            or params.presence_penalty
            or params.frequency_penalty
        ):
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
            logits[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
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

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        max_batch_size: int = 32,
        batch_window_s: float = 0.005,
    ) -> None:
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
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompt_ids: list[int], params: GenerateParams, client: ClientWatch = NO_CLIENT) -> Completion:
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
                    results = self.generate_batch(
                        [p.prompt_ids for p in batch], [p.params for p in batch], [p.is_abandoned for p in batch]
                    )
                for pending, result in zip(batch, results):
                    pending.result = result
            except BaseException as exc:  # handed to every waiting request, answered as a 500
                for pending in batch:
                    pending.error = exc
            finally:
                for pending in batch:
                    pending.done.set()

    def generate_batch(
        self, prompts: list[list[int]], params: list[GenerateParams], abandoned: list[Callable[[], bool]] | None = None
    ) -> list[Completion]:
        """Generate for all ``prompts`` at once (left padding, one forward per step); a row whose
        ``abandoned()`` turns true leaves the batch (its completion is cut where it was)."""
        abandoned = abandoned or [lambda: False] * len(prompts)
        torch = self.torch
        self.batch_sizes[len(prompts)] += 1
        rows = [
            _Row(
                torch,
                prompt,
                p,
                min(p.max_tokens, self.max_model_len - len(prompt)),
                set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids),
            )
            for prompt, p in zip(prompts, params)
        ]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        active = list(range(len(prompts)))
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
            )
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
                out = self.model(
                    input_ids=next_ids,
                    attention_mask=mask,
                    position_ids=position[:, None],
                    past_key_values=cache,
                    use_cache=True,
                )
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
