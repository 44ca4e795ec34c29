"""The token-in/token-out agent loop, end to end: every trajectory is exactly the tokens the
policy saw and produced, with the inference server's own logprobs."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_service.runtime.agent import Agent, Executor, Limits
from rollout_service.runtime.tokens import ChatRenderer, renderer_for
from rollout_service.runtime.toolcalls import get_parser
from rollout_service.runtime.trajectory import TrajectoryBuilder
from rollout_service.sandbox import SandboxSpec, create_sandbox
from rollout_service.schemas import TRUNCATING_REASONS, FinishReason, Trajectory
from rollout_service.tools.schemas import tool_schemas
from tests.helpers import (
    assert_trajectory_is_exactly_what_the_server_returned,
    math_task,
    server_log,
    tool_call,
)

FIVE_TURNS = [
    "First, a variable.\n" + tool_call("ipython", code="x = 6"),
    "Now square it.\n" + tool_call("ipython", code="y = x * x\nprint(y)"),
    "Check a failure mode too.\n" + tool_call("ipython", code="1 / 0"),
    "Halve it.\n" + tool_call("ipython", code="print(y // 2)"),
    "So the answer is \\boxed{18}.\n" + tool_call("finish", answer="\\boxed{18}"),
]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_five_turn_ipython_episode_is_token_exact_on_every_call(client, scripted_backend, tiny_tokenizer_dir, kind):
    problem = f"Compute 6*6/2. ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend({"episodes": [{"match": problem, "turns": FIVE_TURNS}]}, kind=kind)
    (job_id,) = client.submit(math_task(problem, answer="18")).job_ids
    (view,) = client.wait([job_id], timeout_s=120)
    assert view.status.value == "completed", view.error
    assert (view.reward, view.finish_reason.value) == (1.0, "finished")

    trajectory = client.trajectory(job_id)
    assert [t.kind for t in trajectory.turns] == ["generation", "observation"] * 4 + ["generation"]
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(backend.url))
    observations = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert observations[1].strip() == "36"
    assert "ZeroDivisionError" in observations[2]
    assert observations[3].strip() == "18"

    renderer = renderer_for(str(tiny_tokenizer_dir))
    seen = renderer.decode(trajectory.prompt_ids + trajectory.response_ids)
    chat = renderer.render_text(trajectory.messages, tool_schemas(["ipython", "finish"]))
    assert seen == chat.rstrip("\n")


def test_a_malformed_tool_call_is_answered_with_an_error_observation_and_the_episode_goes_on(client, scripted_backend):
    problem = f"Broken call ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        '<tool_call>\n{"name": "ipython", "arguments": {"code": "print(1)"\n</tool_call>',
                        tool_call("nonexistent_tool", x=1),
                        tool_call("finish", answer="4"),
                    ],
                }
            ]
        }
    )
    (job_id,) = client.submit(math_task(problem)).job_ids
    (view,) = client.wait([job_id], timeout_s=120)
    assert view.status.value == "completed" and view.finish_reason.value == "finished"
    trajectory = client.trajectory(job_id)
    errors = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert "JSON" in errors[0]
    assert "nonexistent_tool" in errors[1] and "ipython" in errors[1]
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(backend.url))


def test_the_context_limit_ends_the_episode_cleanly_and_truncated(client, scripted_backend):
    problem = f"Long ({uuid.uuid4().hex[:6]})"
    long_call = "Thinking " * 40 + tool_call("ipython", code="print('x' * 300)")
    backend = scripted_backend({"episodes": [{"match": problem, "turns": [long_call] * 20}]})
    (job_id,) = client.submit(math_task(problem), sampling={"max_model_len": 900}, agent={"max_turns": 20}).job_ids
    (view,) = client.wait([job_id], timeout_s=120)
    assert view.status.value == "completed"
    assert view.finish_reason.value == "context_length"
    trajectory = client.trajectory(job_id)
    assert trajectory.truncated and trajectory.finish_reason.value == "context_length"
    assert len(trajectory.prompt_ids) + len(trajectory.response_ids) <= 900
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(backend.url))


def test_a_generation_cut_by_max_new_tokens_ends_the_episode_as_length_and_truncated(client, scripted_backend):
    problem = f"Rambling ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend({"episodes": [{"match": problem, "turns": ["Let me think " * 40]}]})
    (job_id,) = client.submit(math_task(problem), sampling={"max_new_tokens": 16}).job_ids
    (view,) = client.wait([job_id], timeout_s=120)
    assert view.status.value == "completed" and view.finish_reason.value == "length"
    trajectory = client.trajectory(job_id)
    assert trajectory.truncated and trajectory.finish_reason.value == "length"
    assert trajectory.turns[-1].finish_reason == "length" and len(trajectory.response_ids) == 16
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(backend.url))


def test_max_turns_ends_the_episode_truncated(client, scripted_backend):
    problem = f"Loop ({uuid.uuid4().hex[:6]})"
    scripted_backend({"episodes": [{"match": problem, "turns": [tool_call("ipython", code="1")] * 5}]})
    (view,) = client.wait(client.submit(math_task(problem), agent={"max_turns": 3}).job_ids, timeout_s=120)
    assert view.finish_reason.value == "max_turns"
    trajectory = client.trajectory(view.job_id)
    assert trajectory.truncated and sum(t.kind == "generation" for t in trajectory.turns) == 3


def test_a_real_model_trajectory_carries_the_models_own_logprobs(client, service, model_server, tiny_model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    backend = client.add_backend(model_server, "vllm", "tiny-real", tokenizer=str(tiny_model_dir))
    try:
        (job_id,) = client.submit(
            math_task("What is 2 + 2?"),
            n=1,
            sampling={"model": "tiny-real", "max_new_tokens": 24, "temperature": 1.0, "seed": 7},
            agent={"max_turns": 3},
        ).job_ids
        (view,) = client.wait([job_id], timeout_s=180)
        assert view.status.value == "completed", view.error
        trajectory = client.trajectory(job_id)
    finally:
        client.remove_backend(backend.id)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    offset = len(trajectory.prompt_ids)
    generated = [i for i, m in enumerate(trajectory.loss_mask) if m == 1]
    assert generated
    for i in generated:
        position = offset + i
        expected = logprobs[position - 1, trajectory.response_ids[i]].item()
        assert trajectory.logprobs[i] == pytest.approx(expected, abs=1e-4)


def test_the_job_deadline_cuts_a_slow_llm_call_and_the_job_ends_timed_out_with_its_turns(client, scripted_backend):
    import time

    from tests.helpers import tool_call as call

    problem = f"Deadline ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [call("ipython", code="1"), {"text": call("ipython", code="2"), "delay_s": 30}],
                }
            ]
        }
    )
    started = time.monotonic()
    (job_id,) = client.submit(math_task(problem), timeouts={"job_s": 6}).job_ids
    (view,) = client.wait([job_id], timeout_s=60)
    assert time.monotonic() - started < 15
    assert view.status.value == "timed_out" and view.finish_reason.value == "deadline", view.error
    trajectory = client.trajectory(job_id)
    assert trajectory.truncated and [t.kind for t in trajectory.turns] == ["generation", "observation"]


# -- the Agent alone, in process: a scripted LLM behind the agent's LLM interface, a real tokenizer's
# chat template, the real tool-call parser and a real bwrap sandbox for the tools.


class ScriptedLLM:
    """Answers each call with the next scripted text as token ids, with logprobs of its own choosing
    (distinct per token), recording what it was sent and what it returned."""

    def __init__(self, renderer: ChatRenderer, turns: list[str]) -> None:
        self.renderer, self.turns = renderer, list(turns)
        self.calls: list[dict] = []

    def generate(self, prompt_ids: list[int], max_new_tokens: int, record: TrajectoryBuilder) -> list[int]:
        text = self.turns[len(self.calls)]
        ids = [*self.renderer.encode(text), self.renderer.end_of_turn_id]
        cut = len(ids) > max_new_tokens
        ids = ids[:max_new_tokens]
        logprobs = [-(len(self.calls) + 1) / 8 - k / 1024 for k in range(len(ids))]
        self.calls.append({"prompt_ids": list(prompt_ids), "output_ids": ids, "logprobs": logprobs})
        record.add_generation(
            ids,
            logprobs,
            backend_id="scripted",
            policy_version=3,
            finish_reason="length" if cut else "stop",
            latency_s=0.0,
        )
        return ids


def scripted_agent(
    tiny_tokenizer_dir: Path,
    turns: list[str],
    executor: Executor | None = None,
    tools: tuple[str, ...] = ("bash", "finish"),
    max_turns: int = 8,
    max_new_tokens: int = 256,
    max_model_len: int | None = None,
    stop_reason: Callable[[], FinishReason | None] = lambda: None,
) -> tuple[Agent, ScriptedLLM, list[int], list[dict]]:
    """An Agent on ``turns`` and the prompt init would render for a one-message task."""
    renderer = renderer_for(str(tiny_tokenizer_dir))
    llm = ScriptedLLM(renderer, turns)
    agent = Agent(
        llm=llm,
        renderer=renderer,
        parser=get_parser("hermes"),
        tools=tuple(tools),
        executor=executor,
        limits=Limits(
            max_turns=max_turns, max_new_tokens=max_new_tokens, max_model_len=max_model_len, tool_timeout_s=10
        ),
        stop_reason=stop_reason,
    )
    messages = [{"role": "user", "content": "What is in the workspace?"}]
    return agent, llm, renderer.initial_prompt(messages, tool_schemas(list(tools))), messages


def assert_exactly_the_scripted_tokens(trajectory: Trajectory, calls: list[dict]) -> None:
    """Every generation is the scripted ids and logprobs at its place; the loss mask covers exactly them."""
    generations = [t for t in trajectory.turns if t.kind == "generation"]
    assert len(generations) == len(calls)
    generated: set[int] = set()
    for turn, call in zip(generations, calls):
        assert call["prompt_ids"] == trajectory.prompt_ids + trajectory.response_ids[: turn.start]
        assert trajectory.response_ids[turn.start : turn.end] == call["output_ids"]
        assert trajectory.logprobs[turn.start : turn.end] == call["logprobs"]
        generated.update(range(turn.start, turn.end))
    assert [i for i, m in enumerate(trajectory.loss_mask) if m == 1] == sorted(generated)
    assert all(trajectory.logprobs[i] == 0.0 for i, m in enumerate(trajectory.loss_mask) if m == 0)
    assert len(trajectory.response_ids) == len(trajectory.logprobs) == len(trajectory.loss_mask)


def test_the_agent_runs_tool_call_observation_and_final_answer_with_exactly_the_scripted_tokens(
    tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("forty-two\n")
    turns = [
        "Let me look.\n" + tool_call("bash", command="cat notes.txt"),
        "And a file that is not there.\n" + tool_call("bash", command="cat missing.txt"),
        tool_call("no_such_tool", x=1),
        "It says forty-two.\n" + tool_call("finish", answer="42"),
    ]
    box = create_sandbox("bwrap", SandboxSpec("job-agent", str(tmp_path), tools=("bash", "finish")))
    box.start()
    try:
        agent, llm, prompt_ids, messages = scripted_agent(tiny_tokenizer_dir, turns, executor=box)
        episode = agent.run(prompt_ids, messages)
    finally:
        box.stop()

    trajectory = episode.trajectory
    assert (episode.answer, trajectory.finish_reason, trajectory.truncated) == ("42", FinishReason.finished, False)
    assert [t.kind for t in trajectory.turns] == ["generation", "observation"] * 3 + ["generation"]
    observations = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert "forty-two" in observations[0]
    assert "No such file or directory" in observations[1]  # a tool error is an observation, the episode goes on
    assert "no_such_tool" in observations[2] and "bash" in observations[2]
    assert trajectory.prompt_ids == prompt_ids
    assert all(t.backend_id == "scripted" and t.policy_version == 3 for t in trajectory.turns if t.kind == "generation")
    assert_exactly_the_scripted_tokens(trajectory, llm.calls)


CALLING = [tool_call("no_such_tool", step=k) for k in range(6)]
LIMITS = {  # limit -> (agent settings, scripted turns, generations made)
    "max_turns": ({"max_turns": 2}, CALLING, 2),
    "context_length": ({}, CALLING, 1),  # max_model_len: room for one turn and its observation, not two
    "length": ({"max_new_tokens": 5}, ["Let me think " * 40], 1),
    "no_tool_call": ({}, ["I will not call a tool."], 1),
    "deadline": ({}, CALLING, 1),  # the stop check says deadline once a turn was made
}


@pytest.mark.parametrize("limit", LIMITS, ids=list(LIMITS))
def test_a_limit_ends_the_agents_episode_with_its_finish_reason_and_exact_tokens(
    tiny_tokenizer_dir: Path, limit: str
) -> None:
    _, turns, generations = LIMITS[limit]
    settings: dict[str, Any] = dict(LIMITS[limit][0])
    made: list[dict] = []
    if limit == "deadline":
        settings["stop_reason"] = lambda: FinishReason.deadline if made else None
    if limit == "context_length":
        _, _, prompt_ids, _ = scripted_agent(tiny_tokenizer_dir, turns)
        settings["max_model_len"] = len(prompt_ids) + 60
    agent, llm, prompt_ids, messages = scripted_agent(tiny_tokenizer_dir, turns, **settings)
    llm.calls = made

    trajectory = agent.run(prompt_ids, messages).trajectory
    assert trajectory.finish_reason == FinishReason(limit)
    assert trajectory.truncated == (FinishReason(limit) in TRUNCATING_REASONS)
    assert len(llm.calls) == generations
    if limit == "context_length":
        assert len(trajectory.prompt_ids) + len(trajectory.response_ids) <= settings["max_model_len"]
    assert_exactly_the_scripted_tokens(trajectory, llm.calls)
