"""Inference clients for the vLLM and SGLang token APIs, against the reference server
(scripted replay or the tiny HF model) in a real subprocess over real HTTP."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from rollout_service.devtools.engines import ServerProcess
from rollout_service.devtools.redis_server import free_port
from rollout_service.devtools.reference_engines import scripted_logprob
from rollout_service.devtools.reference_server import ReferenceServerProcess
from rollout_service.errors import (
    BackendError,
    BackendRejected,
    BackendTimeout,
    BackendUnreachable,
    ConfigError,
    ContextWindowExceeded,
    UnknownName,
)
from rollout_service.runtime import inference
from rollout_service.runtime.http_pool import Abort, Aborted
from rollout_service.runtime.inference import (
    COMPLETIONS_PATH,
    GENERATE_PATH,
    ReferenceClient,
    SGLangClient,
    VLLMClient,
    make_client,
)
from rollout_service.runtime.tokens import ChatRenderer, load_tokenizer
from rollout_service.schemas import Sampling
from tests.fixtures_tokens import logged_requests
from tests.helpers import wait_for

KINDS = ["vllm", "sglang"]
CALL = '<tool_call>\n{"name": "ipython", "arguments": {"code": "print(2 + 2)"}}\n</tool_call>'
SCRIPT = {
    "episodes": [
        {"match": "What is 2 + 2?", "turns": ["Let me compute.\n" + CALL, "It is \\boxed{4}."]},
        {"match": "What is 3 + 3?", "turns": [{"text": "Six.", "delay_s": 0.3}]},
    ]
}


@pytest.fixture(autouse=True)
def forget_vllm_routes() -> None:
    """Each test learns the routes of its servers afresh (the mock's URL is the same in every test)."""
    inference._vllm_routes.clear()


@pytest.fixture
def renderer(tiny_tokenizer_dir: Path) -> ChatRenderer:
    return ChatRenderer(load_tokenizer(str(tiny_tokenizer_dir)))


def prompt_for(renderer: ChatRenderer, question: str) -> list[int]:
    return renderer.initial_prompt([{"role": "user", "content": question}], [])


def generate(
    kind: str, url: str, prompt: list[int], max_new_tokens: int = 64, timeout_s: float = 10, **sampling: object
):
    return make_client(kind, url, "tiny").generate(prompt, Sampling(**sampling), max_new_tokens, timeout_s)


def mock_client(client_class: type, handler: Callable[[httpx.Request], httpx.Response]) -> VLLMClient | SGLangClient:
    return client_class(
        "http://mock", "tiny", http=httpx.Client(transport=httpx.MockTransport(handler)), connect_retries=0
    )


# --------------------------------------------------------------------------- against the scripted server


@pytest.mark.parametrize("kind", KINDS)
def test_ids_and_logprobs_are_exactly_what_the_server_logged(kind, scripted_server, renderer):
    url = scripted_server(SCRIPT)
    prompt = prompt_for(renderer, "What is 2 + 2?")
    generation = generate(kind, url, prompt)

    (call,) = logged_requests(url)
    assert call["protocol"] == kind and call["prompt_ids"] == prompt
    assert generation.token_ids == call["output_ids"] and generation.logprobs == call["logprobs"]
    assert generation.logprobs == [scripted_logprob(len(prompt) + i, t) for i, t in enumerate(generation.token_ids)]
    assert renderer.decode(generation.token_ids) == "Let me compute.\n" + CALL + "<|im_end|>"
    assert generation.finish_reason == "stop" and generation.latency_s > 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_next_turn_is_served_after_the_observation_delta_is_appended(kind, scripted_server, renderer):
    url = scripted_server(SCRIPT)
    prompt = prompt_for(renderer, "What is 2 + 2?")
    first = generate(kind, url, prompt)
    prompt += first.token_ids + renderer.observation_delta([{"role": "tool", "content": "4"}], first.token_ids)
    second = generate(kind, url, prompt)
    assert renderer.decode_generation(second.token_ids) == "It is \\boxed{4}."
    assert logged_requests(url)[-1]["prompt_ids"] == prompt


@pytest.mark.parametrize("kind", KINDS)
def test_max_tokens_cuts_the_turn_with_finish_reason_length(kind, scripted_server, renderer):
    url = scripted_server(SCRIPT)
    prompt = prompt_for(renderer, "What is 2 + 2?")
    generation = generate(kind, url, prompt, max_new_tokens=3)
    assert generation.finish_reason == "length"
    assert generation.token_ids == renderer.encode("Let me compute.")[:3]
    assert len(generation.logprobs) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_no_episode_matches_is_rejected_with_the_servers_message(kind, scripted_server, renderer):
    url = scripted_server(SCRIPT)
    with pytest.raises(BackendRejected, match="answered 400 .*no scripted episode matches") as caught:
        generate(kind, url, prompt_for(renderer, "What is 9 + 9?"))
    assert caught.value.status == 400 and url in str(caught.value)


def test_a_script_whose_turns_are_exhausted_says_so(scripted_server, renderer):
    url = scripted_server(SCRIPT)
    prompt = prompt_for(renderer, "What is 3 + 3?")
    first = generate("vllm", url, prompt)
    prompt += first.token_ids + renderer.observation_delta([{"role": "user", "content": "More?"}], first.token_ids)
    with pytest.raises(BackendRejected, match="has 1 turn"):
        generate("vllm", url, prompt)


def test_concurrent_rollouts_of_different_episodes_are_served_in_parallel(scripted_server, renderer):
    url = scripted_server(SCRIPT)
    questions = ["What is 3 + 3?", "What is 2 + 2?"] * 4
    started = time.monotonic()
    with ThreadPoolExecutor(len(questions)) as pool:
        generations = list(pool.map(lambda q: generate("sglang", url, prompt_for(renderer, q)), questions))
    assert time.monotonic() - started < 4 * 0.3
    texts = [renderer.decode_generation(g.token_ids) for g in generations]
    assert texts == ["Six.", "Let me compute.\n" + CALL] * 4


def test_a_slow_server_raises_backend_timeout(scripted_server, renderer):
    url = scripted_server({"episodes": [{"match": "slow", "turns": [{"text": "zzz", "delay_s": 3}]}]})
    with pytest.raises(BackendTimeout, match="did not answer within 0.5 s"):
        generate("vllm", url, prompt_for(renderer, "slow"), timeout_s=0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_an_aborted_call_ends_at_once_and_the_server_stops_generating_for_it(kind, scripted_server, renderer):
    url = scripted_server({"episodes": [{"match": "endless", "turns": [{"text": "late", "delay_s": 60}]}]})
    abort = Abort()
    threading.Timer(0.5, abort.abort).start()
    started = time.monotonic()
    with pytest.raises(Aborted):
        make_client(kind, url, "tiny").generate(prompt_for(renderer, "endless"), Sampling(), 16, 90, abort)
    assert time.monotonic() - started < 1.5
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/health").json()["aborted_requests"] != 1:
        assert time.monotonic() < deadline, "the server went on generating for a client that left"
        time.sleep(0.05)
    assert logged_requests(url) == []


def test_an_abort_before_the_request_is_sent_sends_nothing(scripted_server, renderer):
    url = scripted_server(SCRIPT)
    abort = Abort()
    abort.abort()
    with pytest.raises(Aborted):
        make_client("vllm", url, "tiny").generate(prompt_for(renderer, "What is 2 + 2?"), Sampling(), 16, 10, abort)
    assert logged_requests(url) == []


def test_the_vllm_response_has_token_id_strings_and_a_text_without_special_tokens(scripted_server, renderer):
    url = scripted_server(SCRIPT)
    prompt = prompt_for(renderer, "What is 2 + 2?")
    body = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 50, "logprobs": 0, "return_tokens_as_token_ids": True},
    ).json()
    choice = body["choices"][0]
    assert choice["token_ids"] is None
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert renderer.decode(ids) == "Let me compute.\n" + CALL + "<|im_end|>"
    assert "<tool_call>" not in choice["text"]  # why tool calls are parsed from ids, not text
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt) + len(ids),
    }


def test_a_text_prompt_is_tokenized_by_the_server_for_curl_users(scripted_server, renderer):
    url = scripted_server(SCRIPT)
    text = renderer.decode(prompt_for(renderer, "What is 3 + 3?"))
    body = httpx.post(f"{url}/generate", json={"text": text, "sampling_params": {"skip_special_tokens": False}}).json()
    assert body["text"] == "Six.<|im_end|>" and body["meta_info"]["finish_reason"]["type"] == "stop"


def test_unknown_routes_and_bad_bodies_get_json_errors(scripted_server):
    url = scripted_server(SCRIPT)
    assert httpx.get(f"{url}/nope").json()["error"]["code"] == 404
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": [1, "x"]})
    assert bad.status_code == 400 and "list of token ids" in bad.json()["error"]["message"]


def test_the_fail_rate_knob_injects_503s(scripted_server, renderer):
    url = scripted_server(SCRIPT, "--fail-rate", "1")
    with pytest.raises(BackendRejected, match="503 .*injected failure") as caught:
        generate("vllm", url, prompt_for(renderer, "What is 2 + 2?"))
    assert caught.value.status == 503


def test_a_bad_script_stops_the_server_at_startup_with_the_reason(tmp_path, tiny_tokenizer_dir):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"episodes": [{"turns": ["hi"]}]}))
    server = ReferenceServerProcess(
        ["--script", str(script), "--tokenizer", str(tiny_tokenizer_dir)],
        port=free_port(),
        log_path=tmp_path / "server.log",
    )
    with pytest.raises(ConfigError, match='exited with code 1 while starting(.|\n)*episode 0 needs a "match" string'):
        server.start(timeout_s=30)


def test_a_server_not_healthy_in_time_is_a_config_error_and_is_stopped(tmp_path, tiny_tokenizer_dir):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"episodes": [{"match": "", "turns": ["hi"]}]}))
    server = ReferenceServerProcess(
        ["--script", str(script), "--tokenizer", str(tiny_tokenizer_dir)],
        port=free_port(),
        log_path=tmp_path / "server.log",
    )
    with pytest.raises(ConfigError, match=f"the engine at {server.url} did not answer /health within 0 s"):
        server.start(timeout_s=0.01)
    assert server.process is not None and server.process.poll() is not None


HEALTHY_PARENT = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_process_of_its_own_session_is_stopped_with_its_children(tmp_path):
    port = free_port()
    server = ServerProcess(
        [sys.executable, "-c", HEALTHY_PARENT, str(port)], f"http://127.0.0.1:{port}", tmp_path / "server.log"
    )
    server.poll_s = 0.05
    assert server.start(timeout_s=30) is server and httpx.get(f"{server.url}/health").status_code == 200
    child = int((tmp_path / "server.log").read_text().split()[0])
    assert running(child)
    server.stop()
    assert server.process is not None and server.process.poll() is not None
    wait_for(lambda: not running(child), timeout_s=10, what="the server's child to be stopped with it")


def test_the_server_log_can_be_cleared(scripted_server, renderer):
    url = scripted_server(SCRIPT)
    generate("vllm", url, prompt_for(renderer, "What is 2 + 2?"))
    assert len(logged_requests(url)) == 1
    httpx.delete(f"{url}/debug/requests")
    assert logged_requests(url) == []


# --------------------------------------------------------------------------- wire format, mocked


def assert_has(body: dict, expected: dict) -> None:
    assert {key: body.get(key) for key in expected} == expected


def vllm_payload(choice: dict) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "", "finish_reason": "stop", **choice}],
    }


SAMPLING = dict(
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    seed=7,
    stop_token_ids=[9],
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    min_tokens=4,
    ignore_eos=True,
    logit_bias={"42": 3.5},
)
VLLM_SAMPLING = {
    "max_tokens": 32,
    **SAMPLING,
    "logprobs": 0,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
}


def generate_payload(token_ids: list[int], logprobs: list[float], finish_reason: str = "stop") -> dict:
    return {
        "request_id": "generate-tokens-1",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "token_ids": token_ids,
                "logprobs": {
                    "content": [
                        {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                        for t, lp in zip(token_ids, logprobs)
                    ]
                },
            }
        ],
    }


def test_the_vllm_client_sends_ids_and_every_sampling_parameter_to_the_token_route():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=generate_payload([5, 2], [-0.5, -0.25]))

    generation = mock_client(VLLMClient, handler).generate([1, 2, 3], Sampling(**SAMPLING), 32, 5)
    assert (generation.token_ids, generation.logprobs, generation.finish_reason) == ([5, 2], [-0.5, -0.25], "stop")
    (request,) = seen
    assert request.url.path == GENERATE_PATH
    body = json.loads(request.content)
    assert body == {
        "model": "tiny",
        "token_ids": [1, 2, 3],
        "stream": False,
        "sampling_params": {**VLLM_SAMPLING, "detokenize": False},
    }


def test_the_completions_route_gets_the_same_sampling_parameters_with_token_id_strings_asked():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200,
            json=vllm_payload(
                {
                    "token_ids": [5, 2],
                    "logprobs": {"token_logprobs": [-0.5, -0.25], "tokens": ["token_id:5", "token_id:2"]},
                }
            ),
        )

    mock_client(ReferenceClient, handler).generate([1, 2, 3], Sampling(**SAMPLING), 32, 5)
    (request,) = seen
    assert request.url.path == COMPLETIONS_PATH
    assert json.loads(request.content) == {
        "model": "tiny",
        "prompt": [1, 2, 3],
        **VLLM_SAMPLING,
        "n": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream": False,
    }


def test_min_tokens_is_capped_by_what_the_call_may_generate_and_defaults_are_sent_explicitly():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=generate_payload([5], [-0.5], "length"))

    client = mock_client(VLLMClient, handler)
    client.generate([1], Sampling(min_tokens=10), 3, 5)
    client.generate([1], Sampling(), 3, 5)
    assert seen[0]["sampling_params"]["min_tokens"] == 3
    assert_has(
        seen[1]["sampling_params"],
        {
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "min_tokens": 0,
            "ignore_eos": False,
        },
    )
    assert "logit_bias" not in seen[1]["sampling_params"] and "seed" not in seen[1]["sampling_params"]


def test_a_server_without_the_token_route_is_asked_once_then_served_by_completions():
    paths = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path == GENERATE_PATH:
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(
            200, json=vllm_payload({"token_ids": [7], "logprobs": {"token_logprobs": [-0.5], "tokens": ["token_id:7"]}})
        )

    first = mock_client(VLLMClient, handler).generate([1], Sampling(), 8, 5)
    again = mock_client(VLLMClient, handler).generate([1], Sampling(), 8, 5)  # another client of the same URL
    assert first.token_ids == again.token_ids == [7]
    assert paths == [GENERATE_PATH, COMPLETIONS_PATH, COMPLETIONS_PATH]


def test_calls_made_while_the_first_answer_is_pending_take_completions_and_later_ones_the_token_route():
    paths, release = [], threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path == GENERATE_PATH:
            if len(paths) == 1:
                release.wait(5)
            return httpx.Response(200, json=generate_payload([8], [-0.125]))
        return httpx.Response(
            200,
            json=vllm_payload({"token_ids": [8], "logprobs": {"token_logprobs": [-0.125], "tokens": ["token_id:8"]}}),
        )

    client = mock_client(VLLMClient, handler)
    with ThreadPoolExecutor(1) as pool:
        probe = pool.submit(client.generate, [1], Sampling(), 8, 5)
        while not paths:
            time.sleep(0.01)
        meanwhile = client.generate([1], Sampling(), 8, 5)
        release.set()
        assert probe.result().token_ids == meanwhile.token_ids == [8]
    client.generate([1], Sampling(), 8, 5)
    assert paths == [GENERATE_PATH, COMPLETIONS_PATH, GENERATE_PATH]


def test_a_first_call_that_fails_leaves_the_route_to_be_learned_by_the_next():
    paths = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if len(paths) == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=generate_payload([8], [-0.125]))

    client = mock_client(VLLMClient, handler)
    with pytest.raises(BackendUnreachable):
        client.generate([1], Sampling(), 8, 5)
    assert client.generate([1], Sampling(), 8, 5).token_ids == [8]
    assert paths == [GENERATE_PATH, GENERATE_PATH]


def test_a_404_of_the_token_route_once_it_is_known_is_the_servers_answer_not_a_fallback():
    answers = iter(
        [
            httpx.Response(200, json=generate_payload([8], [-0.125])),
            httpx.Response(404, json={"error": {"message": "The model `tiny` does not exist.", "code": 404}}),
        ]
    )
    client = mock_client(VLLMClient, lambda r: next(answers))
    client.generate([1], Sampling(), 8, 5)
    with pytest.raises(BackendRejected, match="answered 404 to POST /inference/v1/generate: The model `tiny` does not"):
        client.generate([1], Sampling(), 8, 5)


@pytest.mark.parametrize(
    "choice, problem",
    [
        ({"token_ids": ["1"], "logprobs": {"content": []}}, "token_ids is not a list of integers"),
        ({"token_ids": [1]}, "logprobs.content is missing"),
        ({"token_ids": [1], "logprobs": {"content": [{"token_id": 1}]}}, "without token_id and logprob"),
        ({"token_ids": [1], "logprobs": {"content": [{"token_id": 1, "logprob": "x"}]}}, "logprob is not a number"),
        ({"token_ids": [1], "logprobs": {"content": [{"token_id": 2, "logprob": -1.0}]}}, "disagree"),
        ({"token_ids": [1, 2], "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]}}, "disagree"),
        (
            {"token_ids": [1], "finish_reason": "abort", "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]}},
            "finish reason 'abort'",
        ),
    ],
)
def test_malformed_token_route_answers_are_backend_errors(choice, problem):
    client = mock_client(VLLMClient, lambda r: httpx.Response(200, json={"choices": [{"index": 0, **choice}]}))
    with pytest.raises(BackendError, match=problem):
        client.generate([1], Sampling(), 8, 5)


def test_ids_and_logprobs_that_agree_come_back_as_sent_with_integer_logprobs_as_floats():
    client = mock_client(
        ReferenceClient,
        lambda r: httpx.Response(
            200,
            json=vllm_payload(
                {
                    "token_ids": [11, 2],
                    "logprobs": {"token_logprobs": [-1.5, 0], "tokens": ["token_id:11", "token_id:2"]},
                }
            ),
        ),
    )
    generation = client.generate([1], Sampling(), 8, 5)
    assert generation.token_ids == [11, 2] and generation.logprobs == [-1.5, 0.0]
    assert [type(v) for v in generation.logprobs] == [float, float]


def test_the_vllm_client_reads_ids_from_token_ids_when_present():
    client = mock_client(
        ReferenceClient,
        lambda r: httpx.Response(
            200,
            json=vllm_payload(
                {"token_ids": [11, 2], "logprobs": {"token_logprobs": [-1.5, -0.125], "tokens": ["a", "b"]}}
            ),
        ),
    )
    generation = client.generate([1], Sampling(), 8, 5)
    assert generation.token_ids == [11, 2] and generation.logprobs == [-1.5, -0.125]


def test_the_vllm_client_reads_ids_from_token_id_strings_of_older_servers():
    client = mock_client(
        ReferenceClient,
        lambda r: httpx.Response(
            200,
            json=vllm_payload(
                {
                    "finish_reason": "length",
                    "logprobs": {"token_logprobs": [-1.5, -0.1234567890123], "tokens": ["token_id:11", "token_id:700"]},
                }
            ),
        ),
    )
    generation = client.generate([1], Sampling(), 2, 5)
    assert generation.token_ids == [11, 700] and generation.logprobs == [-1.5, -0.1234567890123]
    assert generation.finish_reason == "length"


@pytest.mark.parametrize(
    "choice, problem",
    [
        ({"logprobs": {"token_logprobs": [-1.0], "tokens": ["a"]}}, "neither choices\\[0\\].token_ids"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [-1.0], "tokens": ["token_id:2"]}}, "disagree"),
        (
            {"token_ids": ["1"], "logprobs": {"token_logprobs": [-1.0], "tokens": ["token_id:1"]}},
            "not a list of integers",
        ),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [True], "tokens": ["token_id:1"]}}, "not a list of numbers"),
        (
            {"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0], "tokens": ["x", "y"]}},
            "2 token ids but 1 logprobs",
        ),
        ({"token_ids": [1]}, "logprobs is missing"),
        ({"token_ids": [1], "finish_reason": "abort", "logprobs": {"token_logprobs": [-1.0]}}, "finish reason 'abort'"),
    ],
)
def test_malformed_vllm_answers_are_backend_errors(choice, problem):
    client = mock_client(ReferenceClient, lambda r: httpx.Response(200, json=vllm_payload(choice)))
    with pytest.raises(BackendError, match=problem):
        client.generate([1], Sampling(), 8, 5)


def test_a_generation_the_engine_aborted_is_a_typed_error_the_pool_makes_again():
    from rollout_service.errors import GenerationAborted

    aborted = {"token_ids": [1], "finish_reason": "abort", "logprobs": {"token_logprobs": [-1.0]}}
    client = mock_client(ReferenceClient, lambda r: httpx.Response(200, json=vllm_payload(aborted)))
    with pytest.raises(GenerationAborted, match="mode=abort"):
        client.generate([1], Sampling(), 8, 5)


def test_the_sglang_client_sends_input_ids_and_reads_the_logprob_triples():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(
            200,
            json={
                "text": "",
                "output_ids": [4, 2],
                "meta_info": {
                    "finish_reason": {"type": "stop", "matched": 2},
                    "output_token_logprobs": [[-0.75, 4, None], [-0.0625, 2, None]],
                },
            },
        )

    generation = mock_client(SGLangClient, handler).generate([1, 2], Sampling(seed=3, stop_token_ids=[9]), 16, 5)
    assert (generation.token_ids, generation.logprobs, generation.finish_reason) == ([4, 2], [-0.75, -0.0625], "stop")
    (body,) = seen
    assert body["input_ids"] == [1, 2] and body["return_logprob"] is True
    assert_has(
        body["sampling_params"],
        {
            "max_new_tokens": 16,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [9],
            "skip_special_tokens": False,
            "sampling_seed": 3,
        },
    )


def test_the_sglang_client_forwards_every_sampling_parameter_under_sglangs_names():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["sampling_params"])
        return httpx.Response(
            200, json={"meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 4, None]]}}
        )

    mock_client(SGLangClient, handler).generate([1, 2], Sampling(**SAMPLING), 32, 5)
    (params,) = seen
    assert params == {
        "max_new_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.1,
        "min_new_tokens": 4,
        "ignore_eos": True,
        "stop_token_ids": [9],
        "logit_bias": {"42": 3.5},
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "sampling_seed": 7,
    }


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("min_p", 1.5, "sampling.min_p: must be in [0, 1], got 1.5"),
        ("min_p", -0.1, "sampling.min_p: must be in [0, 1], got -0.1"),
        ("presence_penalty", 2.5, "sampling.presence_penalty: must be in [-2, 2], got 2.5"),
        ("frequency_penalty", -3, "sampling.frequency_penalty: must be in [-2, 2], got -3"),
        ("repetition_penalty", 0, "sampling.repetition_penalty: must be in (0, 2], got 0"),
        ("repetition_penalty", 2.5, "sampling.repetition_penalty: must be in (0, 2], got 2.5"),
        ("min_tokens", -1, "sampling.min_tokens: Input should be greater than or equal to 0"),
        ("min_tokens", 1.5, "sampling.min_tokens: Input should be a valid integer"),
        ("ignore_eos", 1, "sampling.ignore_eos: Input should be a valid boolean"),
        ("logit_bias", {"12": 101}, "sampling.logit_bias: the bias of token 12 must be in [-100, 100], got 101"),
        ("logit_bias", {"a": 1}, "sampling.logit_bias: keys must be token ids (integers >= 0), got 'a'"),
        ("logit_bias", {"-3": 1}, "sampling.logit_bias: keys must be token ids (integers >= 0), got '-3'"),
        ("logit_bias", [1], "sampling.logit_bias: Input should be a valid dictionary"),
    ],
)
def test_sampling_parameters_out_of_their_bounds_are_a_400_naming_the_field_and_the_bound(field, value, message):
    from pydantic import ValidationError

    from rollout_service.schemas import JobRequest, validation_message

    with pytest.raises(ValidationError) as caught:
        JobRequest.model_validate({"task": {"domain": "math"}, "sampling": {field: value}})
    assert validation_message(caught.value) == message


def test_logit_bias_keys_are_token_ids_as_strings_as_json_carries_them():
    assert Sampling(logit_bias={5: 1, "007": -2.5}).logit_bias == {"5": 1.0, "7": -2.5}
    assert Sampling.model_validate_json(
        '{"logit_bias": {"5": 100}, "min_tokens": 3, "ignore_eos": true}'
    ).logit_bias == {"5": 100.0}


def test_a_non_json_answer_is_a_backend_error():
    client = mock_client(SGLangClient, lambda r: httpx.Response(200, text="<html>oops</html>"))
    with pytest.raises(BackendError, match="not JSON"):
        client.generate([1], Sampling(), 8, 5)


def test_a_404_suggests_checking_the_backend_kind():
    client = mock_client(SGLangClient, lambda r: httpx.Response(404, json={"detail": "Not Found"}))
    with pytest.raises(BackendRejected, match="Not Found .*register the backend with the right kind"):
        client.generate([1], Sampling(), 8, 5)


def test_connection_errors_are_retried_against_the_same_server_then_raised():
    attempts = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(str(request.url))
        raise httpx.ConnectError("refused", request=request)

    client = VLLMClient(
        "http://mock", "tiny", http=httpx.Client(transport=httpx.MockTransport(handler)), connect_retries=2
    )
    with pytest.raises(BackendUnreachable):
        client.generate([1], Sampling(), 8, 5)
    assert attempts == ["http://mock/inference/v1/generate"] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_connection_fails_quickly_with_an_error_naming_the_url(kind):
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BackendUnreachable, match=f"cannot reach the {kind} backend at {url}"):
        generate(kind, url, [1, 2, 3])
    assert time.monotonic() - started < 2


def test_make_client_knows_vllm_sglang_and_the_reference_server():
    assert isinstance(make_client("reference", "http://x/", "m"), ReferenceClient)
    assert type(make_client("vllm", "http://x/", "m")) is VLLMClient
    assert isinstance(make_client("sglang", "http://x", "m"), SGLangClient)
    assert make_client("vllm", "http://x/", "m").url == "http://x"
    with pytest.raises(UnknownName, match="valid: reference, sglang, vllm"):
        make_client("tgi", "http://x", "m")


# --------------------------------------------------------------------------- against the tiny HF model


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def independent_logprobs(model: object, prompt: list[int], generated: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0]
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    return [float(log_softmax[len(prompt) - 1 + i, token]) for i, token in enumerate(generated)]


@pytest.fixture
def model_prompt(tiny_model_dir) -> list[int]:
    renderer = ChatRenderer(load_tokenizer(str(tiny_model_dir)))
    return renderer.initial_prompt([{"role": "user", "content": "What is 2 + 2?"}], [])


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_servers_logprobs_are_the_models_own_log_softmax(kind, model_server, model_prompt, tiny_lm):
    generation = generate(kind, model_server, model_prompt, max_new_tokens=24, temperature=1.0, seed=11)
    assert len(generation.token_ids) >= 1
    expected = independent_logprobs(tiny_lm, model_prompt, generation.token_ids)
    assert generation.logprobs == pytest.approx(expected, abs=1e-4)


def test_temperature_zero_is_greedy(model_server, model_prompt, tiny_lm):
    import torch

    generation = generate("vllm", model_server, model_prompt, max_new_tokens=6, temperature=0.0)
    ids = list(model_prompt)
    for token in generation.token_ids:
        with torch.no_grad():
            assert token == int(tiny_lm(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)


def test_the_same_seed_samples_the_same_tokens(model_server, model_prompt):
    first = generate("sglang", model_server, model_prompt, max_new_tokens=12, seed=5, top_p=0.9, top_k=50)
    second = generate("vllm", model_server, model_prompt, max_new_tokens=12, seed=5, top_p=0.9, top_k=50)
    assert first.token_ids == second.token_ids and first.logprobs == second.logprobs


def test_generation_stops_at_a_stop_token_and_includes_it(model_server, model_prompt):
    greedy = generate("vllm", model_server, model_prompt, max_new_tokens=8, temperature=0.0).token_ids
    stop_at = max(i for i, t in enumerate(greedy) if t not in greedy[:i])  # its first occurrence
    stopped = generate(
        "vllm", model_server, model_prompt, max_new_tokens=8, temperature=0.0, stop_token_ids=[greedy[stop_at]]
    )
    assert stopped.token_ids == greedy[: stop_at + 1] and stopped.finish_reason == "stop"


def test_the_model_server_honours_logit_bias_min_tokens_and_ignore_eos_with_raw_logprobs(
    model_server, model_prompt, tiny_lm
):
    greedy = generate("vllm", model_server, model_prompt, max_new_tokens=6, temperature=0.0).token_ids
    favourite = next(t for t in range(5, 500) if t not in greedy)
    biased = generate(
        "vllm",
        model_server,
        model_prompt,
        max_new_tokens=6,
        temperature=1.0,
        logit_bias={str(favourite): 100.0},
        ignore_eos=True,
    )
    assert biased.token_ids == [favourite] * 6 and biased.finish_reason == "length"
    assert biased.logprobs == pytest.approx(independent_logprobs(tiny_lm, model_prompt, biased.token_ids), abs=1e-4)
    held = generate(
        "sglang",
        model_server,
        model_prompt,
        max_new_tokens=12,
        temperature=1.0,
        logit_bias={str(favourite): 100.0},
        stop_token_ids=[favourite],
        min_tokens=5,
    )
    assert favourite not in held.token_ids[:5] and held.token_ids[5] == favourite and len(held.token_ids) == 6


def test_penalties_and_min_p_change_what_the_model_server_samples(model_server, model_prompt):
    plain = generate("vllm", model_server, model_prompt, max_new_tokens=16, temperature=0.0)
    penalised = generate(
        "vllm",
        model_server,
        model_prompt,
        max_new_tokens=16,
        temperature=0.0,
        repetition_penalty=2.0,
        presence_penalty=2.0,
        frequency_penalty=2.0,
    )
    assert penalised.token_ids != plain.token_ids
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))
    only_greedy = [
        generate("vllm", model_server, model_prompt, max_new_tokens=4, temperature=1.0, min_p=1.0, seed=seed).token_ids
        for seed in (1, 2)
    ]
    assert only_greedy == [plain.token_ids[:4]] * 2


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("min_p", 1.5, "'min_p' must be in [0, 1], got 1.5"),
        ("repetition_penalty", 0, "'repetition_penalty' must be in (0, 2], got 0.0"),
        ("presence_penalty", -2.5, "'presence_penalty' must be in [-2, 2], got -2.5"),
        ("min_tokens", 9, "'min_tokens' must be in [0, 8]"),
        ("logit_bias", {"x": 1}, "'logit_bias' keys must be token ids, got 'x'"),
    ],
)
def test_the_reference_server_refuses_sampling_out_of_bounds_naming_the_parameter(
    model_server, model_prompt, field, value, message
):
    answer = httpx.post(f"{model_server}/v1/completions", json={"prompt": model_prompt, "max_tokens": 8, field: value})
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]


def test_the_model_server_lists_its_model_and_context_length(model_server, tiny_model_dir):
    (model,) = httpx.get(f"{model_server}/v1/models").json()["data"]
    assert model["id"] == str(tiny_model_dir) and model["max_model_len"] == 8192


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "status, message, full",
    [
        (
            400,
            "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
            "(4000 in the messages, 1000 in the completion).",
            True,
        ),  # vLLM
        (400, "The input (9000 tokens) is longer than the model's context length (8192 tokens).", True),  # SGLang
        (400, "Input prompt (9000 tokens) is too long and exceeds limit of 8192", True),  # vLLM v1
        (
            400,
            "The decoder prompt (length 4100) is longer than the maximum model length of 4096. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens.",
            True,
        ),  # vLLM's token route
        (413, "prompt is too long", True),
        (400, "temperature must be non-negative, got -1.0", False),
        (500, "This model's maximum context length is 4096 tokens.", False),  # not a refusal of the prompt
    ],
)
def test_a_server_refusing_a_prompt_too_long_for_its_context_is_told_apart(kind, status, message, full):
    client = mock_client(
        VLLMClient if kind == "vllm" else SGLangClient,
        lambda request: httpx.Response(status, json={"error": {"message": message}}),
    )
    with pytest.raises(BackendRejected) as caught:
        client.generate([1, 2, 3], Sampling(), 8, 5)
    assert isinstance(caught.value, ContextWindowExceeded) is full and caught.value.status == status


def test_answers_are_read_float_for_float_as_the_standard_library_reads_them_and_bodies_round_trip():
    import math
    import random
    import struct

    from rollout_service.runtime.inference import dumps_body, loads_answer

    rng = random.Random(7)
    floats = [struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(20000)]
    floats = [f for f in floats if math.isfinite(f)] + [
        -0.0,
        5e-324,
        2.2250738585072014e-308,
        1.7976931348623157e308,
        -9999.0,
        -0.30000000000000004,
        -1e-45,
    ]
    texts = (
        [repr(f) for f in floats]
        + [f"{f:.17g}" for f in floats[:2000]]
        + [f"{f:.25e}" for f in floats[:2000]]
        + ["-0.1234567890123456789012345", "-1.00000000000000011102230246251565404236316680908203125"]
    )
    answer = ('{"logprobs": [' + ", ".join(texts) + '], "ids": [0, 18446744073709551615]}').encode()
    expected = json.loads(answer)
    parsed = loads_answer(answer)
    assert [struct.pack("<d", f) for f in parsed["logprobs"]] == [struct.pack("<d", f) for f in expected["logprobs"]]
    assert parsed["ids"] == expected["ids"]
    assert math.isnan(loads_answer(b'{"x": NaN}')["x"]) and loads_answer(b"[-Infinity]") == [-math.inf]

    body = {"prompt": list(range(600)), "temperature": 0.7, "seed": None, "stop": ["</s>"], "text": "é ✓"}
    assert json.loads(dumps_body(body)) == body
    assert json.loads(dumps_body({1: "a", "big": 2**70})) == {"1": "a", "big": 2**70}


def test_the_model_server_stops_a_generation_whose_client_left_and_serves_the_next_at_once(model_server, model_prompt):
    aborted_before = httpx.get(f"{model_server}/health").json()["aborted_requests"]
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(
            f"{model_server}/v1/completions",
            timeout=1.0,
            json={"prompt": model_prompt, "max_tokens": 8000, "ignore_eos": True, "logprobs": 0},
        )
    started = time.monotonic()
    generation = generate("vllm", model_server, model_prompt, max_new_tokens=4, timeout_s=30, temperature=0.0)
    assert len(generation.token_ids) <= 4 and time.monotonic() - started < 1.0
    assert httpx.get(f"{model_server}/health").json()["aborted_requests"] == aborted_before + 1
