"""The tiny offline tokenizer/model and the chat renderer's token-level prompt building."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from rollout_service.devtools.tiny_model import SPECIAL_TOKENS, build_tiny_tokenizer
from rollout_service.errors import ConfigError
from rollout_service.runtime.tokens import ChatRenderer, load_tokenizer, renderer_for

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ipython",
            "description": "Run Python code.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "Submit the final answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    },
]
TOOL_CALL = '<tool_call>\n{"name": "ipython", "arguments": {"code": "print(2 + 2)"}}\n</tool_call>'


@pytest.fixture
def renderer(tiny_tokenizer_dir: Path) -> ChatRenderer:
    return ChatRenderer(load_tokenizer(str(tiny_tokenizer_dir)))


def fresh_tokenizer(directory: Path, chat_template: str):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    tokenizer.chat_template = chat_template
    return tokenizer


def first_messages() -> list[dict]:
    return [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is 2 + 2?"}]


# --------------------------------------------------------------------------- tiny tokenizer


def test_the_tiny_tokenizer_round_trips_text_and_keeps_each_special_token_whole(renderer):
    text = "<|im_start|>user\nWhat is 12 * 7? Use café's ünïcode 日本 🙂.\n\tdef f(x): return x<|im_end|>\n"
    ids = renderer.encode(text)
    assert renderer.decode(ids) == text
    for token in SPECIAL_TOKENS:
        assert len(renderer.encode(token)) == 1, token
    assert 500 <= len(renderer.tokenizer) <= 2048


def test_the_tiny_tokenizer_loads_offline_with_auto_tokenizer_and_the_model_dir_tokenizes_the_same(
    tiny_tokenizer_dir, tiny_model_dir, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    alone = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    with_model = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = 'Hello   world!! 123456\n\n  <tool_call>\n{"a": [1, 2]}\n</tool_call><|im_end|>'
    assert alone.encode(text, add_special_tokens=False) == with_model.encode(text, add_special_tokens=False)
    assert alone.eos_token == "<|im_end|>" and alone.chat_template == with_model.chat_template


def test_building_the_tiny_tokenizer_again_leaves_it_untouched(tiny_tokenizer_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_tokenizer_dir.iterdir()}
    assert build_tiny_tokenizer(tiny_tokenizer_dir) == tiny_tokenizer_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_tokenizer_dir.iterdir()} == before


def test_the_tiny_model_has_the_tokenizers_vocabulary_and_stops_at_im_end(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (tiny_model_dir / "model.safetensors").stat().st_size < 5_000_000


def test_loading_a_tokenizer_from_a_missing_directory_says_what_to_pass(tmp_path):
    with pytest.raises(ConfigError, match="local directory"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_a_tokenizer_name_not_on_this_machine_fails_at_once_without_asking_the_model_hub():
    started = time.monotonic()
    with pytest.raises(ConfigError, match="'tiny'.*Hugging Face cache"):
        load_tokenizer("tiny")
    assert time.monotonic() - started < 5


def test_a_tokenizer_stuck_loading_does_not_hold_up_loading_another(tmp_path, tiny_tokenizer_dir, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    stuck, other = tmp_path / "stuck", tmp_path / "other"
    shutil.copytree(tiny_tokenizer_dir, stuck)
    shutil.copytree(tiny_tokenizer_dir, other)
    release = threading.Event()
    load = PreTrainedTokenizerFast.from_pretrained.__func__

    def slow_for_stuck(cls, path, *args, **kwargs):  # a load waiting on a slow disk or network mount
        if str(path) == str(stuck):
            release.wait(30)
        return load(cls, path, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", classmethod(slow_for_stuck))
    first = threading.Thread(target=load_tokenizer, args=(str(stuck),), daemon=True)
    first.start()
    time.sleep(0.2)
    try:
        loaded = []
        second = threading.Thread(target=lambda: loaded.append(renderer_for(str(other))), daemon=True)
        second.start()
        second.join(timeout=20)
        assert loaded, "loading one tokenizer waited for another one's load"
        assert first.is_alive()
    finally:
        release.set()
        first.join(timeout=20)


def test_tokenizer_problem_names_what_was_looked_for_and_accepts_loadable_tokenizers(tmp_path, tiny_tokenizer_dir):
    from rollout_service.runtime.tokens import tokenizer_problem

    assert tokenizer_problem(str(tiny_tokenizer_dir)) is None
    name = tokenizer_problem("tiny")
    assert "'tiny'" in name and "Hugging Face cache" in name and "directory" in name
    empty = tokenizer_problem(str(tmp_path))
    assert str(tmp_path) in empty and "tokenizer.json" in empty
    missing = tokenizer_problem(str(tmp_path / "nowhere"))
    assert "nowhere" in missing and "no such directory" in missing


# --------------------------------------------------------------------------- chat template


def test_the_initial_prompt_renders_the_tool_schemas_and_ends_with_the_generation_prompt(renderer):
    text = renderer.decode(renderer.initial_prompt(first_messages(), TOOLS))
    assert text.startswith("<|im_start|>system\nSolve it.\n\n# Tools")
    for tool in TOOLS:
        assert json.dumps(tool) in text
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_without_tools_the_prompt_is_plain_chatml(renderer):
    text = renderer.decode(renderer.initial_prompt(first_messages(), []))
    assert text == (
        "<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_assistant_tool_calls_render_in_hermes_format_and_tool_results_as_tool_responses(renderer):
    messages = [
        *first_messages(),
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [
                {"type": "function", "function": {"name": "ipython", "arguments": {"code": "print(2 + 2)"}}}
            ],
        },
        {"role": "tool", "content": "4"},
    ]
    text = renderer.render_text(messages, TOOLS)
    assert f"<|im_start|>assistant\nLet me compute.\n{TOOL_CALL}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n")


def test_the_renderer_finds_the_end_of_turn_and_generation_prompt_in_the_template(renderer):
    assert renderer.end_of_turn == "<|im_end|>"
    assert renderer.end_of_turn_id == renderer.tokenizer.eos_token_id
    assert renderer.eos_token_ids == [renderer.end_of_turn_id]
    assert renderer.generation_prompt == "<|im_start|>assistant\n"


# --------------------------------------------------------------------------- observation deltas


def test_prompt_plus_generations_plus_deltas_is_exactly_what_the_full_template_renders(renderer):
    messages = first_messages()
    ids = renderer.initial_prompt(messages, TOOLS)
    turns = [
        ("Let me compute.\n" + TOOL_CALL, [{"role": "tool", "content": "4"}]),
        ("Check once more.\n" + TOOL_CALL, [{"role": "tool", "content": "4"}, {"role": "tool", "content": "ok"}]),
        ("It is 4.", [{"role": "user", "content": "Call finish, please."}]),
    ]
    for text, observation in turns:
        generated = renderer.encode(text) + [renderer.end_of_turn_id]
        ids += generated + renderer.observation_delta(observation, generated)
        messages += [{"role": "assistant", "content": text}, *observation]

    full_text = renderer.render_text(messages, TOOLS, add_generation_prompt=True)
    assert renderer.decode(ids) == full_text
    assert ids == renderer.encode(full_text)


def test_the_delta_frames_tool_results_and_ends_with_the_generation_prompt(renderer):
    delta = renderer.observation_delta([{"role": "tool", "content": "4"}], [renderer.end_of_turn_id])
    assert renderer.decode(delta) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_generation_cut_by_length_is_closed_with_the_end_of_turn_before_the_observation(renderer):
    cut = renderer.encode("Let me comp")
    delta = renderer.observation_delta([{"role": "user", "content": "Go on."}], cut)
    assert delta[0] == renderer.end_of_turn_id
    assert (
        renderer.decode(cut + delta)
        == "Let me comp<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_delta_is_derived_from_any_chatml_like_template_not_hardcoded(tiny_tokenizer_dir):
    template = (
        "{% for m in messages %}"
        "{% if m.role == 'tool' %}<|im_start|>tool name={{ m.name }}\n{{ m.content }}<|im_end|>\n\n"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant:\n{% endif %}"
    )
    renderer = ChatRenderer(fresh_tokenizer(tiny_tokenizer_dir, template))
    observation = [{"role": "tool", "name": "bash", "content": "done"}]
    delta = renderer.observation_delta(observation, renderer.encode("ok") + [renderer.end_of_turn_id])
    assert renderer.decode(delta) == "\n\n<|im_start|>tool name=bash\ndone<|im_end|>\n\n<|im_start|>assistant:\n"
    assert renderer.generation_prompt == "<|im_start|>assistant:\n"


def test_a_template_that_rewrites_history_when_messages_are_added_is_refused(tiny_tokenizer_dir):
    template = (
        "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(fresh_tokenizer(tiny_tokenizer_dir, template))
    with pytest.raises(ConfigError, match="renders earlier turns differently"):
        renderer.observation_delta([{"role": "user", "content": "hi"}], [])


def test_a_template_without_an_end_of_turn_token_is_refused(tiny_tokenizer_dir):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="end-of-turn"):
        ChatRenderer(fresh_tokenizer(tiny_tokenizer_dir, template))


def test_completed_turns_counts_the_assistant_turns_before_the_final_generation_prompt(renderer):
    ids = renderer.initial_prompt(first_messages(), TOOLS)
    assert renderer.completed_turns(renderer.decode(ids)) == 0
    generated = renderer.encode("thinking") + [renderer.end_of_turn_id]
    ids += generated + renderer.observation_delta([{"role": "tool", "content": "1"}], generated)
    assert renderer.completed_turns(renderer.decode(ids)) == 1


def test_decode_keeps_special_tokens_and_decode_generation_drops_only_the_final_end_of_turn(renderer):
    generated = renderer.encode(TOOL_CALL) + [renderer.end_of_turn_id]
    assert renderer.decode(generated) == TOOL_CALL + "<|im_end|>"
    assert renderer.decode_generation(generated) == TOOL_CALL
    assert renderer.decode_generation(generated[:-1]) == TOOL_CALL


def test_the_tiny_tokenizer_is_built_in_seconds(tmp_path):
    import time

    started = time.monotonic()
    build_tiny_tokenizer(tmp_path / "tok")
    assert time.monotonic() - started < 10
    assert sorted(os.listdir(tmp_path)) == ["tok"]


def test_the_renderer_tokenizes_and_decodes_exactly_as_the_transformers_tokenizer_does(renderer):
    """The renderer calls the Rust tokenizer directly and tokenizes the texts between special tokens
    on their own, caching those prompts repeat; neither may change a single id."""
    import random

    tokenizer = renderer.tokenizer
    assert renderer._rust is not None and renderer._special_split is not None  # the fast paths are what this checks
    rng = random.Random(7)
    texts = [
        renderer.render_text([{"role": "user", "content": "what is 2+2?"}], add_generation_prompt=True),
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
        "émoji 🎉 ünïcode\t\n  ",
    ]
    texts += [
        "".join(rng.choice('ab <|>\n 12xyz_im_startend{}"é') for _ in range(rng.randint(1, 80))) for _ in range(300)
    ]
    pieces = [*SPECIAL_TOKENS, " ", "\n", "  x", "user", "é ", "12", "<|", "|>", "<tool_call", "\n\n "]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for text in texts + texts:  # the second time from the segments cached the first
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        assert renderer.encode(text) == ids, text
        assert renderer.decode(ids) == tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )


READING_TEMPLATE = (  # reads what the wrapper adds or drops: special-token variables, aliased reasoning, None keys
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.tool_calls is defined %}[calls]{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}{{ tools | length }} tools{{ eos_token }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", ["tiny", "reading"])
def test_the_direct_template_render_is_what_apply_chat_template_renders(tiny_tokenizer_dir, template):
    """The renderer renders the compiled template itself, without transformers' per-call wrapper;
    on any conversation it must give the wrapper's text to the character."""
    import random

    tokenizer = (
        load_tokenizer(str(tiny_tokenizer_dir))
        if template == "tiny"
        else fresh_tokenizer(tiny_tokenizer_dir, READING_TEMPLATE)
    )
    renderer = ChatRenderer(tokenizer)
    assert renderer._direct is not None  # the fast path is what this checks
    rng = random.Random(11)
    words = ["2 + 2", "<tool_call>", '{"a": 1}', "émoji 🎉", "\n\n", "  ", "<|im_end|>", "ok", "Error: no"]

    def text() -> str:
        return "".join(rng.choice(words) for _ in range(rng.randint(0, 6)))

    def message() -> dict:
        role = rng.choice(["user", "assistant", "tool", "system"])
        m = {"role": role, "content": text()}
        if role == "tool":
            m["name"] = rng.choice(["bash", "ipython"])
        if role == "assistant" and rng.random() < 0.3:
            m[rng.choice(["reasoning_content", "reasoning"])] = text()
        if rng.random() < 0.2:
            m["tool_calls"] = None
        return m

    for _ in range(300):
        messages = [message() for _ in range(rng.randint(1, 6))]
        tools = rng.choice([None, TOOLS])
        generation_prompt = rng.random() < 0.5
        expected = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert renderer.render_text(messages, tools, generation_prompt) == expected, messages


def test_a_direct_render_that_differs_from_the_wrapper_is_not_used(tiny_tokenizer_dir, monkeypatch):
    from rollout_service.runtime import tokens

    monkeypatch.setattr(tokens._DirectTemplate, "render", lambda self, *args: "something else")
    renderer = ChatRenderer(load_tokenizer(str(tiny_tokenizer_dir)))
    assert renderer._direct is None
    assert renderer.render_text(first_messages(), add_generation_prompt=True).endswith("<|im_start|>assistant\n")


TRIMMING_TEMPLATE = (  # Llama-3-like: every content trimmed
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TESTING_TEMPLATE = (  # Qwen3-like: what a content holds changes how it is framed
    "{% for m in messages %}{% if m.role == 'user' and m.content.startswith('<tool_response>') %}"
    "<|im_start|>tool\n{% else %}<|im_start|>{{ m.role }}\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", ["tiny", "reading", "trimming", "testing"])
def test_prompts_and_observations_filled_into_a_frame_are_what_the_template_renders(tiny_tokenizer_dir, template):
    """Shapes seen before are rendered by filling contents into a frame, never into one of a template
    that trims or tests its contents; either way the text is the template's to the character."""
    import random

    tokenizer = (
        load_tokenizer(str(tiny_tokenizer_dir))
        if template == "tiny"
        else fresh_tokenizer(
            tiny_tokenizer_dir,
            {"reading": READING_TEMPLATE, "trimming": TRIMMING_TEMPLATE, "testing": TESTING_TEMPLATE}[template],
        )
    )
    renderer = ChatRenderer(tokenizer)
    rng = random.Random(7)
    words = [
        "2 + 2",
        "<tool_call>",
        "<tool_response>",
        '{"a": 1}',
        "{{ x }}",
        "émoji 🎉",
        "\n\n",
        "  ",
        "<|im_end|>",
        "ok",
        "\x00FRAME0\x00",
    ]

    def message(role: str) -> dict:
        m = {"role": role, "content": "".join(rng.choice(words) for _ in range(rng.randint(0, 5)))}
        if role == "tool":
            m["name"] = rng.choice(["bash", "ipython"])
        return m

    for _ in range(400):
        roles = rng.choice([["system", "user"], ["user"], ["tool"], ["tool", "tool"], ["user", "tool"]])
        messages = [message(role) for role in roles]
        tools = rng.choice([None, TOOLS])
        generation_prompt = rng.random() < 0.7
        expected = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert renderer.render_framed(messages, tools, generation_prompt) == expected, messages
        if roles[0] == "tool" and any(m["content"] for m in messages):
            assert renderer.decode(
                renderer.observation_delta(messages, [renderer.end_of_turn_id])
            ) == renderer.observation_text(messages)
    framed = {shape: frame is not None for shape, frame in renderer._frames.items()}
    tested = {shape: framed[shape] for shape in framed if any(("role", "user") in m for m in shape[2])}
    assert any(framed.values()) if template != "trimming" else not any(framed.values())
    assert tested and (any(tested.values()) if template in ("tiny", "reading") else not any(tested.values()))
