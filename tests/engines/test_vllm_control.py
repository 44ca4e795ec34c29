"""The service as the control plane of a real vLLM: pause (keep, wait) and resume reach the engine,
update_weights reloads it from disk, and a call frozen across a weight sync records both versions."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

from rollout_service.devtools.engines import VLLMServer
from rollout_service.errors import ApiError
from tests.helpers import math_task

PROMPT_IDS = [1, 9690, 314, 253, 1345, 2989, 30]  # any fixed ids: their logprobs are the served policy


def is_paused(engine: VLLMServer) -> bool:
    return httpx.get(f"{engine.url}/is_paused", timeout=10).json()["is_paused"]


def prompt_logprobs(engine: VLLMServer) -> list[float]:
    answer = httpx.post(
        f"{engine.url}/v1/completions",
        timeout=120,
        json={"model": engine.model, "prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0},
    )
    answer.raise_for_status()
    return [next(iter(entry.values()))["logprob"] for entry in answer.json()["choices"][0]["prompt_logprobs"][1:]]


def running_requests(engine: VLLMServer) -> float:
    metrics = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")
    )


def wait_running(engine: VLLMServer, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while running_requests(engine) < 1:
        assert time.monotonic() < deadline, "the job's generation never started in the engine"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def perturbed_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's checkpoint with its final norm scaled: another policy of the same architecture."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("perturbed")
    tensors = load_file(str(smollm2_dir / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(smollm2_dir / "config.json", directory / "config.json")
    return directory


@pytest.fixture
def registered(client, vllm_engine: VLLMServer, smollm2_dir: Path):
    backend = client.add_backend(vllm_engine.url, "vllm", vllm_engine.model, tokenizer=str(smollm2_dir))
    try:
        yield backend
    finally:
        client.resume()
        client.remove_backend(backend.id)


def test_pause_keep_and_wait_reach_vllm_and_resume_clears_them(client, vllm_engine: VLLMServer, registered):
    for mode in ("keep", "wait"):
        paused = client.pause(mode=mode, ttl_s=120)
        assert paused["paused"] and paused["mode"] == mode
        assert [(e["backend_id"], e["ok"], e["error"]) for e in paused["engines"]] == [(registered.id, True, None)]
        assert is_paused(vllm_engine)
        resumed = client.resume()
        assert [e["ok"] for e in resumed["engines"]] == [True] and not resumed["paused"]
        assert not is_paused(vllm_engine)


def test_update_weights_changes_the_served_policy_and_a_frozen_call_records_both_versions(
    client, vllm_engine: VLLMServer, smollm2_dir: Path, perturbed_dir: Path, registered, tmp_path: Path
):
    original = prompt_logprobs(vllm_engine)
    sampling = {"model": vllm_engine.model, "max_new_tokens": 400, "temperature": 1.0, "seed": 7}
    long_job = client.submit(
        math_task("Write a very long story about a dragon who learns to add numbers. Then answer: what is 2 + 2?"),
        sampling=sampling,
        agent={"max_turns": 1, "tools": ["finish"]},
    ).job_ids[0]
    wait_running(vllm_engine)
    frozen = client.pause(mode="keep", ttl_s=300)
    assert frozen["inflight_calls"] >= 1 and is_paused(vllm_engine), frozen
    before = frozen["policy_version"]
    with pytest.raises(ApiError) as bad:
        client.update_weights(str(tmp_path), model=vllm_engine.model)
    assert bad.value.http_status == 400 and "`model_path`" in str(bad.value) and str(tmp_path) in str(bad.value)
    updated = client.update_weights(str(perturbed_dir), model=vllm_engine.model, policy_version=before + 1)
    assert updated["policy_version"] == before + 1 and [e["ok"] for e in updated["engines"]] == [True], updated
    assert client.resume()["policy_version"] == before + 1  # the version of the weights loaded in this pause
    assert not is_paused(vllm_engine)
    changed = prompt_logprobs(vllm_engine)
    assert max(abs(a - b) for a, b in zip(original, changed)) > 0.05

    [view] = client.wait([long_job], timeout_s=300)
    assert view.status.value == "completed", view.error
    turn = client.trajectory(long_job).turns[0]
    assert (turn.policy_version, turn.resumed_under) == (before, before + 1)
    later = client.submit(
        math_task("What is 2 + 2? Answer in \\boxed{}."),
        sampling={**sampling, "max_new_tokens": 16},
        agent={"max_turns": 1, "tools": ["finish"]},
    ).job_ids[0]
    assert client.wait([later], timeout_s=300)[0].status.value == "completed"
    assert [(t.policy_version, t.resumed_under) for t in client.trajectory(later).turns if t.kind == "generation"] == [
        (before + 1, None)
    ]

    restored = client.update_weights(str(smollm2_dir), model=vllm_engine.model)
    assert restored["policy_version"] == before + 2
    assert max(abs(a - b) for a, b in zip(original, prompt_logprobs(vllm_engine))) < 1e-4


def test_a_call_an_abort_pause_dropped_is_made_again_after_resume_and_its_job_completes(
    client, vllm_engine: VLLMServer, registered
):
    sampling = {
        "model": vllm_engine.model,
        "max_new_tokens": 300,
        "min_tokens": 300,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 11,
    }
    job_id = client.submit(
        math_task("Count to one thousand, slowly."), sampling=sampling, agent={"max_turns": 1, "tools": ["finish"]}
    ).job_ids[0]
    wait_running(vllm_engine)
    dropped = client.pause(mode="abort", ttl_s=120)
    assert [e["ok"] for e in dropped["engines"]] == [True], dropped
    time.sleep(1)
    assert running_requests(vllm_engine) == 0
    client.resume()

    [view] = client.wait([job_id], timeout_s=300)
    assert view.status.value == "completed", view.error
    generations = [t for t in client.trajectory(job_id).turns if t.kind == "generation"]
    assert len(generations) == 1 and generations[0].end - generations[0].start == 300
