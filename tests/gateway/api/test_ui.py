"""The trajectory viewer renders real jobs in a real headless Chromium (no special browser flags)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.helpers import math_task, tool_call

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")


def chromium(url: str, tmp: Path, *mode: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{uuid.uuid4().hex[:6]}"
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--window-size=1280,1600",
            "--virtual-time-budget=5000",
            *mode,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_viewer_shows_jobs_errors_tool_arguments_masked_tokens_and_timings(
    client, scripted_backend, service, tmp_path, tiny_tokenizer_dir
):
    from PIL import Image

    problem = f"Viewer ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        "Let me compute.\n" + tool_call("ipython", code="print(2 + 2)"),
                        "\\boxed{4}\n" + tool_call("finish", answer="\\boxed{4}"),
                    ],
                }
            ]
        }
    )
    dead = client.add_backend("http://127.0.0.1:9", "vllm", "ui-dead", tokenizer=str(tiny_tokenizer_dir))
    try:
        (good,) = client.submit(math_task(problem), sampling={"model": "scripted"}).job_ids
        (bad,) = client.submit(math_task(problem), sampling={"model": "ui-dead"}, agent={"tools": ["finish"]}).job_ids
        views = {v.job_id: v for v in client.wait([good, bad], timeout_s=120)}
    finally:
        client.remove_backend(dead.id)
    assert views[good].status.value == "completed" and views[bad].status.value == "failed"

    page = chromium(f"{service.url}/ui/#{good}", tmp_path, "--dump-dom").stdout
    assert good in page and bad in page  # both in the job list
    assert 'class="tok masked"' in page and 'class="tok policy"' in page
    assert "logprob -" in page or "logprob 0" in page  # a policy token's hover text
    assert "tool call: ipython" in page and '{\n  "code": "print(2 + 2)"\n}' in page  # arguments as pretty JSON
    assert "parsed_answer" in page and "queued_s" in page  # eval details and stage timings

    failed = chromium(f"{service.url}/ui/#{bad}", tmp_path, "--dump-dom").stdout
    assert 'class="error"' in failed and views[bad].error.message.split(";")[0][:40] in failed

    shot = tmp_path / "viewer.png"
    chromium(f"{service.url}/ui/#{good}", tmp_path, f"--screenshot={shot}")
    shutil.copy(shot, tmp_path.parent / "viewer-last.png")  # for a human to look at
    image = Image.open(shot).convert("L")
    assert image.size == (1280, 1600)
    low, high = image.getextrema()
    assert high - low > 100  # not blank: text and coloured token chips on white
    assert len(set(image.resize((64, 80)).tobytes())) > 20
