"""docs/settings.md is generated from rollout_service/settings.py and lists every setting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rollout_service import settings

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_docs_settings_md_is_the_generated_table() -> None:
    assert DOC.read_text() == settings.markdown(), (
        "docs/settings.md is out of date: run .venv/bin/python -m rollout_service.settings --markdown > docs/settings.md"
    )


def test_every_setting_has_a_row_with_its_meaning() -> None:
    rows = {row["name"]: row for row in settings.reference()}
    assert list(rows) == [f.name for f in dataclasses.fields(settings.Settings)]
    for name, row in rows.items():
        assert row["meaning"], f"Settings.{name} needs a trailing comment saying what it does (docs/settings.md)"
        assert f"| `ROLLOUT_{name.upper()}` |" in DOC.read_text()


def test_defaults_as_documented() -> None:
    rows = {row["name"]: row for row in settings.reference()}
    assert rows["port"]["default"] == "`8006`"
    assert rows["job_ttl_s"]["default"] == "`604800` (7 * 24 * 3600)"
    assert rows["run_workers"]["default"] == "`min(CORES, 4)`"
    assert rows["score_in_run"]["default"] == "`true`"
    assert rows["redis_url"]["default"] == "(empty)"
    assert rows["job_deadline_s"]["unit"] == "seconds"
