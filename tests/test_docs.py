"""The reference pages in docs/ agree with the code: error codes, metric names, settings named."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

from rollout_service import errors
from rollout_service.settings import Settings
from rollout_service.state.metrics_recording import COUNTERS, HISTOGRAMS

ROOT = Path(__file__).resolve().parent.parent
GATEWAY_CODES = {"method_not_allowed": 405}  # answered by the gateway itself, no class of errors.py


def table_rows(page: str, heading: str) -> list[list[str]]:
    text = (ROOT / page).read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    return [
        [cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| `")
    ]


def test_the_error_code_table_of_docs_api_md_matches_errors_py() -> None:
    documented = {row[0].strip("`"): (int(row[1]), row[2]) for row in table_rows("docs/api.md", "## Error codes")}
    classes = [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.RolloutError) and "code" in vars(cls)
    ]
    expected = {cls.code: (cls.http_status, cls.__name__) for cls in classes}
    for code, (status, name) in expected.items():
        assert code in documented, f"docs/api.md: error code {code!r} ({name}) is missing from the table"
        assert documented[code][0] == status, f"docs/api.md: {code!r} is HTTP {status} in errors.py"
        assert f"`{name}`" in documented[code][1], f"docs/api.md: {code!r} is raised as {name}"
    for code, status in GATEWAY_CODES.items():
        assert documented[code][0] == status
    assert set(documented) == set(expected) | set(GATEWAY_CODES), "docs/api.md lists codes errors.py does not have"


def exported_metrics() -> set[str]:
    """Every metric family and sample name GET /metrics can answer (metrics.py and metrics_recording.py)."""
    source = (ROOT / "rollout_service" / "gateway" / "metrics.py").read_text()
    names = set(re.findall(r'"(rollout_[a-z_]+)"', source))
    names |= {
        f"rollout_backend_{field}"
        for field in re.findall(r'\("([a-z_]+)", "[A-Z1]', source)
        if not field.startswith("rollout_")
    }  # f"rollout_backend_{field}" of metrics._render_backends
    names |= {f"{name}_total" for name in COUNTERS}
    names |= set(HISTOGRAMS) | {f"{name}_{part}" for name in HISTOGRAMS for part in ("bucket", "sum", "count")}
    return names


def test_the_grafana_dashboard_and_operations_page_query_only_exported_metrics() -> None:
    exported = exported_metrics()
    dashboard = json.loads((ROOT / "docs" / "grafana" / "rollout-service.json").read_text())
    queried = set(re.findall(r"\brollout_[a-z_]+", json.dumps(dashboard)))
    assert queried, "the dashboard queries no metric"
    assert queried <= exported, f"the dashboard queries metrics the service does not export: {queried - exported}"
    listed = set(re.findall(r"`(rollout_[a-z_]+)", (ROOT / "docs" / "operations.md").read_text()))
    assert listed <= exported, f"docs/operations.md names metrics the service does not export: {listed - exported}"


SCRIPT_VARIABLES = {  # read by slurm/*.sbatch, given to a harness / tool inside its sandbox, or read by the test suite
    "ROLLOUT_SWE_DATA",
    "ROLLOUT_SHARED_DIR",
    "ROLLOUT_BROKER_REDIS_PORT",
    "ROLLOUT_REDIS_BIND",
    "ROLLOUT_REDIS_HOST",
    "ROLLOUT_REDIS_PORT",
    "ROLLOUT_REDIS_TLS_CERT",
    "ROLLOUT_REDIS_TLS_KEY",
    "ROLLOUT_REDIS_TLS_CA",
    "ROLLOUT_INIT_SANDBOX",
    "ROLLOUT_RUN_SANDBOX",
    "ROLLOUT_EVAL_SANDBOX",
    "ROLLOUT_INFERENCE_PORT",
    "ROLLOUT_ANSWER_FILE",
    "ROLLOUT_WORKSPACE",
    "ROLLOUT_MESSAGES_FILE",
}


def test_every_rollout_variable_the_docs_name_exists() -> None:
    settings = {f"ROLLOUT_{name.upper()}" for name in Settings.__dataclass_fields__}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        named = set(re.findall(r"\bROLLOUT_[A-Z][A-Z0-9_]*[A-Z0-9]\b", page.read_text()))
        unknown = named - settings - SCRIPT_VARIABLES - {"ROLLOUT_X"}
        assert not unknown, f"{page.relative_to(ROOT)} names variables that do not exist: {sorted(unknown)}"


def anchor(heading: str) -> str:
    """GitHub's id of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve() -> None:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if fragment and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
                assert fragment in {anchor(h) for h in headings}, (
                    f"{page.relative_to(ROOT)} links to {target}: no such heading in {path or page.name}"
                )
