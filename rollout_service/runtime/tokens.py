"""Token ids in, token ids out: the chat template rendered once, then only appended to.

The initial prompt is the chat template applied to the first messages with the tool schemas
and the generation prompt. After each generation the next prompt is the previous prompt +
the generated ids + an *observation delta*: the new (tool/user) messages with the role
framing the template gives them, then the generation prompt, tokenized on their own. The
history is never re-rendered or re-tokenized, so the ids the policy produced stay exactly
the ids it is trained on.

The delta is derived from the template itself, not from hard-coded ChatML strings: render a
fixed probe conversation (user, assistant) with and without the new messages and take the
text after the probe's last end-of-turn token. A shape of messages (roles, names, tools) the
template has rendered once, and puts every content into verbatim, is afterwards filled in, not
rendered again (``ChatRenderer.render_framed``): a sandboxed Jinja render at every turn would be
a large share of a run worker's CPU.
"""

from __future__ import annotations

import collections
import functools
import json
import re
import threading
from pathlib import Path
from typing import Any, cast

from rollout_service.errors import ConfigError

_PROBE_USER = "PROBE-USER-MESSAGE"
_PROBE_ASSISTANT = "PROBE-ASSISTANT-MESSAGE"
PROBE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "user", "content": _PROBE_USER},
    {"role": "assistant", "content": _PROBE_ASSISTANT},
)


PROMPT_CACHE_SIZE = 512
FRAME_CACHE_SIZE = 256  # message shapes (roles, names, tools) a process renders by filling a frame
# contents a frame is checked on before it is used: a template that trims, tests or rewrites a
# message's content renders one of them differently from the frame filled with it, and that shape
# is then always rendered by the template
_FRAME_CHECKS = (
    "x",
    "  padded\n\n",
    "\n",
    "<tool_response>\nout\n</tool_response>",
    "a</think>\nb",
    '{"q": "\\"x\\""}\t{{ raw }}',
    "<|im_end|>",
    "ÿ émoji 🎉",
)
SEGMENT_CACHE_SIZE = 4096  # texts between special tokens (system prompts, tool schemas, role headers)
_importing = threading.Lock()  # transformers' lazy imports are not thread-safe on first use
_locks_lock = threading.Lock()
_name_locks: dict[str, threading.RLock] = {}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _lock_for(name_or_path: str) -> threading.RLock:
    """One lock per tokenizer: a slow or failing load never holds up another tokenizer's."""
    with _locks_lock:
        return _name_locks.setdefault(name_or_path, threading.RLock())


def load_tokenizer(name_or_path: str) -> Any:
    """A transformers tokenizer, loaded once per process (safe from many worker threads), from a
    local directory or the Hugging Face cache: never from the network."""
    with _lock_for(name_or_path):
        return _load_tokenizer(name_or_path)


def _transformers() -> Any:
    with _importing:
        import transformers

        return transformers


@functools.lru_cache(maxsize=16)
def _load_tokenizer(name_or_path: str) -> Any:
    problem = tokenizer_problem(name_or_path)
    if problem is not None:
        raise ConfigError(problem)
    transformers = _transformers()
    try:
        if _is_plain_tokenizers_dir(Path(name_or_path)):
            # What AutoTokenizer would pick here too, without importing torch (slow to import).
            return transformers.PreTrainedTokenizerFast.from_pretrained(name_or_path, local_files_only=True)
        return transformers.AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load a tokenizer from {name_or_path!r} ({exc}); pass a local directory "
            "holding tokenizer.json/tokenizer_config.json (e.g. one built with "
            "`python -m rollout_service.devtools.tiny_model DIR`) or a model name already in the "
            "Hugging Face cache"
        ) from exc


def tokenizer_problem(name_or_path: str) -> str | None:
    """Why ``name_or_path`` is no tokenizer this machine can load offline, or None: a directory
    holding a tokenizer's files, or a model name whose tokenizer is in the Hugging Face cache.
    Cheap (no transformers): what registering a backend checks."""
    wanted = "/".join(TOKENIZER_FILES)
    shown = repr(name_or_path[:200])
    try:
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            if any((path / name).is_file() for name in TOKENIZER_FILES):
                return None
            return (
                f"tokenizer {shown}: the directory holds none of {wanted}; pass the directory of the "
                "model's tokenizer (e.g. the model's own directory)"
            )
    except (OSError, RuntimeError):  # a name too long for a path, "~user" of an unknown user
        path = None
    if path is None or path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1:
        return f"tokenizer {shown}: no such directory on this machine; pass a local directory holding {wanted}"
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = any(isinstance(try_to_load_from_cache(name_or_path, name), str) for name in TOKENIZER_FILES)
    except (ValueError, OSError):  # not a valid repository id
        cached = False
    if cached:
        return None
    return (
        f"tokenizer {shown} is neither a local directory nor a model name whose tokenizer is in the "
        f"Hugging Face cache ({constants.HF_HUB_CACHE}); tokenizers load offline: pass a directory "
        f"holding {wanted}, or download it first (`huggingface-cli download {name_or_path[:200]}`)"
    )


def _is_plain_tokenizers_dir(path: Path) -> bool:
    """A tokenizer-only directory (no model config) whose config names the generic class."""
    config_path = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config_path.is_file() or (path / "config.json").exists():
        return False
    try:
        config = json.loads(config_path.read_text())
    except ValueError:
        return False
    return "auto_map" not in config and config.get("tokenizer_class") in (
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
    )


RENDERERS_KEPT = 16
_renderers: dict[str, ChatRenderer] = {}  # the loaded ones, read without the lock (twice per episode)


def renderer_for(name_or_path: str) -> ChatRenderer:
    """The (cached) renderer of the tokenizer at ``name_or_path``; beyond ``RENDERERS_KEPT`` the
    one loaded first is dropped."""
    renderer = _renderers.get(name_or_path)
    if renderer is None:
        with _lock_for(name_or_path):
            renderer = _renderers.get(name_or_path)  # another thread may have loaded it meanwhile
            if renderer is None:
                renderer = ChatRenderer(load_tokenizer(name_or_path))
                with _locks_lock:
                    while len(_renderers) >= RENDERERS_KEPT:
                        _renderers.pop(next(iter(_renderers)), None)
                    _renderers[name_or_path] = renderer
    return renderer


_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        },
    }
]
_DIRECT_RENDER_PROBES: tuple[tuple[list[dict[str, Any]], list[dict[str, Any]] | None], ...] = (
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], None),
    ([{"role": "user", "content": "u"}], _PROBE_TOOLS),
    (
        [*PROBE_CONVERSATION, {"role": "tool", "name": "probe", "content": "out"}, {"role": "user", "content": "u2"}],
        None,
    ),
    (
        [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": None},
        ],
        _PROBE_TOOLS,
    ),
)


_DIRECT_TEMPLATE_NEEDS = ("_alias_reasoning_fields", "_compile_jinja_template", "_plain_template_data")


class _DirectTemplate:
    """The tokenizer's chat template rendered as ``apply_chat_template(tokenize=False)`` renders it
    for plain JSON messages, without the wrapper's per-call work (choosing and compiling the
    template, converting the special-token variables and every message to plain data), repeated
    at every turn otherwise. The messages here are plain JSON already; None-valued keys are dropped
    and reasoning fields aliased as the wrapper does. The renderer checks it against the wrapper
    when it is built."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers.utils.chat_template_utils import (
            _alias_reasoning_fields,
            _compile_jinja_template,
            _plain_template_data,
        )

        self.tokenizer = tokenizer
        self._compile = _compile_jinja_template
        self._alias_reasoning = _alias_reasoning_fields
        self._variables = _plain_template_data(dict(tokenizer.special_tokens_map))
        self._templates: dict[bool, Any] = {}

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        template = self._templates.get(tools is not None)
        if template is None:
            template = self._templates[tools is not None] = self._compile(self.tokenizer.get_chat_template(None, tools))
        chat = self._alias_reasoning([{k: v for k, v in m.items() if v is not None} for m in messages])
        return template.render(
            messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self._variables
        )


def _direct_template(tokenizer: Any) -> _DirectTemplate | None:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.utils import chat_template_utils
    except ImportError:
        return None
    if not all(hasattr(chat_template_utils, name) for name in _DIRECT_TEMPLATE_NEEDS):
        return None  # another transformers: its wrapper, as it is
    if type(tokenizer).apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template:
        return None  # a tokenizer class with its own rendering
    return _DirectTemplate(tokenizer)


Frame = tuple[list[str], list[int]]  # a render cut at its contents: the literal parts, whose content follows each


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


def _fill(frame: Frame, contents: list[str]) -> str:
    parts, order = frame
    pieces = [parts[0]]
    for part, index in zip(parts[1:], order):
        pieces += (contents[index], part)
    return "".join(pieces)


class ChatRenderer:
    """Renders prompts and observation deltas to token ids with a tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "use an instruct/chat model's tokenizer or add a chat_template to its "
                "tokenizer_config.json / chat_template.jinja"
            )
        self.tokenizer = tokenizer
        # the Rust tokenizer under a fast transformers tokenizer: the same ids without the wrapper's
        # per-call Python, which outweighs the tokenization itself; None for a slow tokenizer
        self._rust = (
            getattr(tokenizer, "_tokenizer", None)
            if getattr(tokenizer, "is_fast", False) and not getattr(tokenizer, "split_special_tokens", False)
            else None
        )
        self._special_split, self._added_ids = self._segmenting(self._rust)
        self._segments: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._prompts: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._prompts_lock = threading.Lock()
        self._frames: collections.OrderedDict[tuple, Frame | None] = collections.OrderedDict()
        self._direct = _direct_template(tokenizer)
        if self._direct is not None and not self._direct_renders_alike():
            self._direct = None
        probe = self.render_text(list(PROBE_CONVERSATION))
        after_content = probe[probe.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT) :]
        self.end_of_turn, self.turn_closing = self._find_end_of_turn(after_content)
        self.end_of_turn_id: int = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        self.turn_closing_ids: list[int] = self.encode(self.turn_closing)
        self._probe_prefix = probe[: probe.rindex(self.end_of_turn) + len(self.end_of_turn)]
        with_prompt = self.render_text(list(PROBE_CONVERSATION), add_generation_prompt=True)
        self.generation_prompt: str = with_prompt[len(probe) :] if with_prompt.startswith(probe) else ""
        eos_ids = [self.end_of_turn_id, tokenizer.eos_token_id]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos_ids if i is not None))

    def _find_end_of_turn(self, after_content: str) -> tuple[str, str]:
        """The first special token the template puts after an assistant message's content."""
        specials = set(self.tokenizer.all_special_tokens) | {str(t) for t in self.tokenizer.get_added_vocab()}
        found = [(after_content.find(s), s) for s in specials if s and s in after_content]
        if not found:
            raise ConfigError(
                "the chat template does not end an assistant turn with a special token "
                f"(after the content it renders {after_content!r}); token-level observation "
                "deltas need a ChatML-like template with an end-of-turn token"
            )
        index, token = min(found, key=lambda pair: (pair[0], -len(pair[1])))
        return token, after_content[: index + len(token)]

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        if self._direct is not None:
            return self._direct.render(messages, tools or None, add_generation_prompt)
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def render_framed(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tools_key: str | None = None,
    ) -> str:
        """``render_text``'s text, made by filling the messages' contents into the template's render
        of their shape (roles and every other field, the tools) when that shape was rendered before:
        string joins instead of a sandboxed Jinja render per episode start and per turn. A shape is
        framed only where the template puts every content in verbatim (checked on several contents,
        ``_FRAME_CHECKS``, and the first real ones); others, and empty contents, are rendered.
        ``tools_key``: ``_tools_key(tools)``, when the caller has it already."""
        contents = [m.get("content") for m in messages]
        if not all(isinstance(c, str) and c for c in contents):
            return self.render_text(messages, tools, add_generation_prompt)
        try:
            shape = (
                add_generation_prompt,
                _tools_key(tools) if tools_key is None else tools_key,
                tuple(tuple(sorted((k, v) for k, v in m.items() if k != "content")) for m in messages),
            )
            hash(shape)
        except TypeError:  # a field with a list or dict value (tool calls): rendered
            return self.render_text(messages, tools, add_generation_prompt)
        with self._prompts_lock:
            known = shape in self._frames
            frame = self._frames.get(shape)
        if frame is None:
            text = self.render_text(messages, tools, add_generation_prompt)
            if not known:
                frame = self._make_frame(messages, tools, add_generation_prompt, text)
                with self._prompts_lock:
                    self._frames[shape] = frame
                    while len(self._frames) > FRAME_CACHE_SIZE:
                        self._frames.popitem(last=False)
            return text
        return _fill(frame, cast("list[str]", contents))

    def _make_frame(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        rendered: str,
    ) -> Frame | None:
        """The render of ``messages``' shape cut at each content (literal parts, and which message's
        content goes after each), or None if filling it does not give the template's render."""
        marks = [f"\x00FRAME{i}\x00" for i in range(len(messages))]
        try:
            template = self.render_text(
                [{**m, "content": mark} for m, mark in zip(messages, marks)], tools, add_generation_prompt
            )
        except Exception:
            return None
        cut = re.split("\x00FRAME(\\d+)\x00", template)
        frame: Frame = (cut[0::2], [int(i) for i in cut[1::2]])
        if any("\x00FRAME" in part for part in frame[0]):
            return None
        if _fill(frame, [m["content"] for m in messages]) != rendered:
            return None
        for check in _FRAME_CHECKS:
            contents = [f"{check}{i}" if i % 2 else check for i in range(len(messages))]
            try:
                expected = self.render_text(
                    [{**m, "content": c} for m, c in zip(messages, contents)], tools, add_generation_prompt
                )
            except Exception:
                return None
            if _fill(frame, contents) != expected:
                return None
        return frame

    def _direct_renders_alike(self) -> bool:
        """The direct render gives apply_chat_template's text on conversations of every kind of
        message this service renders (else it is not used)."""
        assert self._direct is not None
        for messages, tools in _DIRECT_RENDER_PROBES:
            for add_generation_prompt in (False, True):
                try:
                    expected = self.tokenizer.apply_chat_template(
                        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
                    )
                except Exception:  # a template that rejects a probe: the wrapper decides, as always
                    return False
                if self._direct.render(messages, tools, add_generation_prompt) != expected:
                    return False
        return True

    @staticmethod
    def _segmenting(rust: Any) -> tuple[Any, dict[str, int]]:
        """How the tokenizer cuts text at its added tokens before anything else, when that cut is
        plain: no added token strips spaces, matches whole words only or matches normalized text.
        Then the texts between them tokenize on their own, and the ones every prompt repeats (the
        system prompt, tool schemas, role headers) are tokenized once (``encode``)."""
        if rust is None:
            return None, {}
        added = rust.get_added_tokens_decoder()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return None, {}
        ids = {t.content: i for i, t in added.items()}
        return re.compile("(" + "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True)) + ")"), ids

    def encode(self, text: str) -> list[int]:
        """Tokenize text on its own, with no BOS/EOS added (templates write their own)."""
        if self._special_split is not None:
            ids: list[int] = []
            for piece in self._special_split.split(text):
                if piece in self._added_ids:
                    ids.append(self._added_ids[piece])
                elif piece:
                    ids += self._segment(piece)
            return ids
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _segment(self, text: str) -> list[int]:
        ids = self._segments.get(text)
        if ids is None:
            if self._rust is None:
                raise TypeError("segments are cut only for a fast tokenizer (see _segmenting)")
            ids = self._rust.encode(text, add_special_tokens=False).ids
            if len(self._segments) >= SEGMENT_CACHE_SIZE:
                self._segments.popitem(last=False)
            self._segments[text] = ids
        return ids

    def initial_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The rendered first prompt; the rollouts of a group share one rendering (cached)."""
        tools_key = _tools_key(tools)
        key = json.dumps(messages, sort_keys=True) + tools_key
        with self._prompts_lock:
            ids = self._prompts.get(key)
        if ids is None:
            ids = self.encode(self.render_framed(messages, tools, add_generation_prompt=True, tools_key=tools_key))
            with self._prompts_lock:
                self._prompts[key] = ids
                while len(self._prompts) > PROMPT_CACHE_SIZE:
                    self._prompts.popitem(last=False)
        return list(ids)

    def observation_text(self, messages: list[dict[str, Any]]) -> str:
        """The text the template puts after a closed assistant turn for ``messages``,
        up to and including the next generation prompt."""
        if not messages:
            raise ValueError("an observation needs at least one message")
        full = self.render_framed([*PROBE_CONVERSATION, *messages], add_generation_prompt=True)
        if not full.startswith(self._probe_prefix):
            raise ConfigError(
                "the chat template renders earlier turns differently once new messages are "
                "added, so observations cannot be appended as token deltas; use a template "
                "that never rewrites history"
            )
        return full[len(self._probe_prefix) :]

    def observation_delta(self, messages: list[dict[str, Any]], generated_ids: list[int]) -> list[int]:
        """Ids to append after ``generated_ids``: the end-of-turn if the generation did not
        emit it (e.g. cut by length), then ``messages`` framed as the template frames them,
        then the generation prompt."""
        closing = [] if generated_ids and generated_ids[-1] == self.end_of_turn_id else self.turn_closing_ids
        return [*closing, *self.encode(self.observation_text(messages))]

    def completed_turns(self, prompt_text: str) -> int:
        """How many assistant turns a decoded prompt holds before its final generation prompt."""
        marker = self.generation_prompt
        if not marker:
            return prompt_text.count(self.end_of_turn)
        count = prompt_text.count(marker)
        return count - 1 if prompt_text.endswith(marker) else count

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens kept (tool-call tags may be special tokens)."""
        if self._rust is not None:
            return self._rust.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode_generation(self, ids: list[int]) -> str:
        """Text of a generation without its final end-of-turn/eos token, for tool-call parsing."""
        ids = list(ids)
        if ids and ids[-1] in self.eos_token_ids:
            ids = ids[:-1]
        return self.decode(ids)
