"""Operations files: the sbatch and shell scripts parse and pass shellcheck, and docker-compose.yml
(which cannot be run here: no Docker engine or compose plugin) is checked as data."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rollout_service.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("slurm/*.sbatch"), *ROOT.glob("sandbox_images/*.sh")])
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DEPENDS_ON_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_parses_and_passes_shellcheck(script):
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    assert shutil.which("shellcheck"), "shellcheck is missing: apt-get install shellcheck (make install does it)"
    checked = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout


def rollout_commands(command: list[str]) -> list[list[str]]:
    """The rollout-service command lines of a service, also inside ``sh -c '... & exec ...'``."""
    if command[:2] == ["sh", "-c"]:
        parts = [shlex.split(part.strip()) for part in command[2].split("&")]
        return [p[1:] if p[0] == "exec" else p for p in parts if p]
    return [command]


def test_every_compose_service_has_a_healthcheck_and_waits_for_healthy_dependencies():
    for name, service in SERVICES.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"
            assert spec["condition"] in DEPENDS_ON_CONDITIONS, f"{name}: {spec}"
            assert spec["condition"] == "service_healthy", f"{name} should wait for a healthy {dependency}"


def test_compose_commands_are_valid_cli_calls_and_worker_healthchecks_ping_their_own_node():
    for name, service in SERVICES.items():
        if name == "redis":
            continue
        for command in rollout_commands(service["command"]):
            assert command[0] == "rollout-service", f"{name}: {command}"
            args = build_parser().parse_args(command[1:])
            if args.command == "worker":
                node = args.hostname.replace("%h", "$$HOSTNAME")
                assert f"inspect ping -t 10 -d {node}" in service["healthcheck"]["test"][-1], name


def test_compose_requires_the_api_token_wherever_a_port_is_published_beyond_loopback():
    for name, service in SERVICES.items():
        public = [p for p in service.get("ports", []) if not str(p).startswith("127.0.0.1:")]
        if public:
            assert service["environment"]["ROLLOUT_API_TOKEN"].startswith("${ROLLOUT_API_TOKEN:?"), name
            assert service["environment"]["ROLLOUT_BIND_HOST"] == "0.0.0.0", name


def test_every_compose_container_that_starts_sandboxes_runs_its_own_reaper():
    for name in ("worker-run", "worker-eval"):
        commands = [build_parser().parse_args(c[1:]) for c in rollout_commands(SERVICES[name]["command"])]
        assert [c.command for c in commands] == ["reap", "worker"], name
        assert commands[0].every_s and not commands[0].all_hosts, name
