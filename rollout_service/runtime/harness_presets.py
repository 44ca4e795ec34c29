"""Harness environments and presets: where a harness's software comes from, and how known agents
are run non-interactively inside a sandbox.

A harness environment (``agent.harness.env_dir``) is a virtualenv or a directory prepared ahead
(``rollout-service harness install NAME``), under a directory the operator allows. The sandbox
binds it read-only at its own path and puts its ``bin/`` first on the harness's PATH.

A preset is one entry of ``PRESETS``: the packages ``harness install`` puts in its environment,
the command (from the task text, the model name and the attempt's private directory), the
environment it needs, and where its answer is found once it exits.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rollout_service.errors import ConfigError, UnknownName, ValidationError
from rollout_service.schemas import HarnessConfig
from rollout_service.settings import get_settings


@dataclass(frozen=True)
class Preset:
    packages: tuple[str, ...]
    command: Callable[[str, str, str], list[str]]  # (task text, model, private directory) -> argv
    env: dict[str, str] = field(default_factory=dict)  # values may name {private_dir}
    answer_json: tuple[str, tuple[str, ...]] | None = None  # (file in the private directory, keys to the answer)


def _mini_swe_agent(task: str, model: str, private_dir: str) -> list[str]:
    return [
        "mini",
        "--yolo",
        "--cost-limit",
        "0",
        "--exit-immediately",
        "--model",
        f"openai/{model}",
        "--output",
        f"{private_dir}/mini.traj.json",
        "--task",
        task,
    ]


PRESETS: dict[str, Preset] = {
    "mini-swe-agent": Preset(
        packages=("mini-swe-agent==2.4.6",),
        command=_mini_swe_agent,
        env={
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_SILENT_STARTUP": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": "{private_dir}/mini-swe-agent",
        },
        answer_json=("mini.traj.json", ("info", "submission")),
    ),
}


@dataclass(frozen=True)
class Launch:
    """What the launcher runs: argv, extra environment, and where the answer is if not in the answer file."""

    command: list[str]
    env: dict[str, str]
    answer_json: tuple[str, tuple[str, ...]] | None = None


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownName("harness preset", name, PRESETS) from None


def launch(harness: HarnessConfig, task_text: str, model: str, private_dir: str) -> Launch:
    """The command and environment of ``harness`` for one attempt (a preset's, with the job's overrides)."""
    if harness.preset is None:
        assert harness.command is not None
        return Launch(list(harness.command), dict(harness.env))
    preset = get_preset(harness.preset)
    command = list(harness.command) if harness.command else preset.command(task_text, model, private_dir)
    answer = (f"{private_dir}/{preset.answer_json[0]}", preset.answer_json[1]) if preset.answer_json else None
    env = {**{key: value.format(private_dir=private_dir) for key, value in preset.env.items()}, **harness.env}
    return Launch(command, env, answer)


def is_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def allowed_env_dir(env_dir: str, where: str = "agent.harness.env_dir") -> str:
    """``env_dir`` resolved, if it is an existing directory under a root the operator allows."""
    if not os.path.isabs(env_dir) or "\x00" in env_dir:
        raise ValidationError(f"{where} must be an absolute path, got {env_dir!r}")
    settings = get_settings()
    resolved = os.path.realpath(env_dir)
    roots = settings.harness_root_paths
    shown = f"{env_dir}{f' (resolved: {resolved})' if resolved != env_dir else ''}"
    if not any(is_under(resolved, root) for root in roots):
        raise ValidationError(
            f"{where} {shown} is outside the directories harness environments may be read from "
            f"({', '.join(roots)}); prepare it under one of them (rollout-service harness install NAME), "
            "or have the operator add its directory to ROLLOUT_HARNESS_ROOTS"
        )
    if is_under(resolved, os.path.realpath(settings.workspaces_path)):
        raise ValidationError(
            f"{where} {shown} is in the jobs' workspace directory, which agents write: "
            "give an environment the operator put in place"
        )
    if not os.path.isdir(resolved):
        raise ValidationError(
            f"{where} {shown} does not exist or is not a directory on this machine; "
            "prepare it with: rollout-service harness install NAME --into DIR"
        )
    return resolved


def env_dir_inside(harness: HarnessConfig) -> str | None:
    """The harness environment's path as bound into the sandbox (symlinks resolved), if it has one."""
    return os.path.realpath(harness.env_dir) if harness.env_dir else None


def read_only_dirs(harness: HarnessConfig | None) -> tuple[str, ...]:
    """What a job's sandbox binds read-only for its harness."""
    inside = env_dir_inside(harness) if harness is not None else None
    return (inside,) if inside else ()


def check_harness(harness: HarnessConfig, at: str = "") -> None:
    """What the schema cannot see: the preset is known and the environment directory allowed."""
    if harness.preset is not None and harness.preset not in PRESETS:
        raise ValidationError(
            f"{at}agent.harness.preset {harness.preset!r} is unknown; valid: {', '.join(sorted(PRESETS))}"
        )
    if harness.env_dir is not None:
        allowed_env_dir(harness.env_dir, f"{at}agent.harness.env_dir")


def install(name: str, into: str | None = None, packages: tuple[str, ...] = (), python: str = "") -> Path:
    """Make (or update) the virtualenv ``into`` (default state_dir/harnesses/NAME) with the preset's
    packages and ``packages``, readable by every sandbox uid; returns its path."""
    wanted = (*get_preset(name).packages, *packages) if name in PRESETS else packages
    if not wanted:
        raise ConfigError(
            f"{name!r} is not a preset (valid: {', '.join(sorted(PRESETS))}); "
            "name the packages to install with --package SPEC"
        )
    target = Path(into) if into else get_settings().state_path / "harnesses" / name
    target = target.resolve()
    interpreter = python or os.path.realpath(os.path.join(sys.base_prefix, "bin", "python3"))
    if not (target / "bin" / "python").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _run([interpreter, "-m", "venv", str(target)])
    _run([str(target / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *wanted])
    for root, dirs, files in os.walk(target):
        for entry in [*dirs, *files]:
            path = os.path.join(root, entry)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                os.chmod(path, mode | 0o444 | (0o111 if mode & 0o100 else 0))
    target.chmod(0o755)
    return target


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"{shlex.join(argv)} failed (exit code {done.returncode}): {done.stderr[-2000:]}")
