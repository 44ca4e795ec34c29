"""The package's shape, as pyproject.toml's import-linter contracts state it: workers import
rollout_service and never the reverse, rollout_service's packages are layered by role, the pipeline's
stages do not import each other, and no modules or packages import each other in a circle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_import_contract_is_kept() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout[-4000:]
    assert "0 broken" in result.stdout


def test_a_state_module_importing_the_gateway_breaks_the_layers(tmp_path: Path) -> None:
    config = (ROOT / "pyproject.toml").read_text()
    offender = ROOT / "rollout_service" / "state" / "_layer_probe.py"
    offender.write_text("from rollout_service.gateway import app  # noqa: F401\n")
    try:
        (tmp_path / "contracts.toml").write_text(config)
        result = lint_imports("--config", str(tmp_path / "contracts.toml"), "--no-cache")
    finally:
        offender.unlink()
    assert result.returncode != 0
    assert "rollout_service.state is not allowed to import rollout_service.gateway" in result.stdout
