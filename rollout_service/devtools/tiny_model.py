"""An offline tiny model for tests and ``make up``: nothing is downloaded.

``build_tiny_tokenizer`` trains a byte-level BPE tokenizer on a built-in corpus and saves it
with a ChatML chat template that supports tools the way Qwen2.5 / Hermes do (tool schemas in
the system message, calls as ``<tool_call>{json}</tool_call>``, results as ``tool`` messages
framed as ``<tool_response>`` blocks). ``build_tiny_model`` adds a small random-weight Qwen2
causal LM next to it. Both are idempotent and write atomically (build in a temporary sibling
directory, then move the files in, the file that marks completeness last, under a file lock).
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [
    END_OF_TEXT,
    IM_START,
    IM_END,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
VOCAB_SIZE = 1024
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_PROSE = """\
You are a helpful assistant. Solve the problem step by step, use the tools when they help,
and put the final answer in \\boxed{}. When you are done, call the finish tool with the answer.
The quick brown fox jumps over the lazy dog. A rollout is a sequence of turns: the policy
generates text, the environment answers with an observation, and the reward comes at the end.
Reinforcement learning from verifiable rewards scores each answer against the ground truth.
Let me think about this. First, compute the sum. Then check the result with Python.
The answer is correct. The test failed because the function returned the wrong value.
I will open the file, read the code, fix the bug, and run the tests again.
Each worker takes a job from the queue, starts a sandbox, runs the agent, and stores the
trajectory. The trainer polls the service for finished groups and updates the policy weights.
Numbers, fractions and equations: two plus two is four, half of ten is five, the square of
three is nine, and the derivative of x squared is two times x. Probability, expectation,
variance, integral, matrix, vector, polynomial, triangle, circle, radius, perimeter, area.
The function returns a list of strings. The variable is undefined. The error message says
that the module was not found, so install the package or fix the import path first.
Question: which of the following choices is correct? Choices: (A) red (B) green (C) blue.
"""

_CODE = """\
def add(a, b):
    return a + b


def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


import math
print(math.sqrt(16), sum(range(10)), [x * x for x in range(5)])
for i in range(3):
    print(f"step {i}: value={i * 2}")
$ ls -la
$ cat README.md
$ python -m pytest tests/ -x -q
$ git diff
"""

_TOOL_TEXT = """\
<tool_call>
{"name": "ipython", "arguments": {"code": "print(2 + 2)"}}
</tool_call>
<tool_call>
{"name": "bash", "arguments": {"command": "ls -la"}}
</tool_call>
<tool_call>
{"name": "editor", "arguments": {"command": "view", "path": "/workspace/main.py"}}
</tool_call>
<tool_call>
{"name": "finish", "arguments": {"answer": "4"}}
</tool_call>
<tool_response>
4
</tool_response>
{"type": "function", "function": {"name": "bash", "description": "Run a bash command.", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
"""


def tiny_corpus() -> list[str]:
    """A few KB of English, math, code and tool-call text; deterministic."""
    arithmetic = [
        f"What is {a} + {b}? {a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}."
        for a, b in zip(range(3, 90, 7), range(11, 200, 13))
    ]
    products = [f"{a} * {b} = {a * b}" for a in range(2, 12) for b in (3, 7, 12)]
    chat = [f"{IM_START}user\n{line}{IM_END}\n{IM_START}assistant\n{line}{IM_END}\n" for line in _PROSE.splitlines()]
    return [_PROSE, _CODE, _TOOL_TEXT, *arithmetic, "\n".join(products), *chat]


def build_once(out_dir: Path, write: Callable[[Path], None], done_marker: str) -> Path:
    """``out_dir`` written by ``write`` once: built in a temporary sibling directory, then moved in
    with ``done_marker`` last, under a file lock so concurrent callers wait for one build. The lock
    file goes once the marker is there (whoever locks a new one then finds the marker)."""
    out_dir = Path(out_dir)
    if (out_dir / done_marker).is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out_dir / done_marker).is_file():
            _build_into(out_dir, write, done_marker)
        lock_path.unlink(missing_ok=True)
    return out_dir


def _build_into(out_dir: Path, write: Callable[[Path], None], done_marker: str) -> None:
    built = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(built)
        out_dir.mkdir(exist_ok=True)
        names = sorted(p.name for p in built.iterdir() if p.name != done_marker)
        for name in [*names, done_marker]:
            (built / name).replace(out_dir / name)
    finally:
        shutil.rmtree(built, ignore_errors=True)


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Exactly Qwen2's normalizer and pre-tokenizer: transformers 5 loads a directory whose
    # config.json says model_type "qwen2" with its own Qwen2Tokenizer class, which rebuilds
    # these from scratch; anything else would tokenize differently depending on the loader.
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(tiny_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (IM_END, END_OF_TEXT)],
        chat_template=CHATML_TOOLS_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )
    tokenizer.save_pretrained(directory)


def build_tiny_tokenizer(out_dir: Path) -> Path:
    """Train and save the tiny tokenizer under ``out_dir`` (skipped when already there)."""
    return build_once(out_dir, _write_tokenizer, done_marker="tokenizer.json")


def _write_model(directory: Path, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(directory)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    assert isinstance(eos_id, int) and isinstance(pad_id, int)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        # Large init so that the random model's next-token distributions are peaked,
        # which makes logprob comparisons in tests meaningful.
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()  # float32, torch's default dtype
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(directory)


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Tokenizer + a random-weight 2-layer Qwen2 causal LM under ``out_dir`` (skipped when there)."""

    def write(directory: Path) -> None:
        _write_tokenizer(directory)
        _write_model(directory, seed)

    return build_once(out_dir, write, done_marker="config.json")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build the offline tiny tokenizer/model.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokenizer-only", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_tokenizer(args.out_dir) if args.tokenizer_only else build_tiny_model(args.out_dir, seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
