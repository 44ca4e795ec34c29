"""SWE jobs from images on a running service: 32 jobs over the 4 SWE-bench images of tests/swe_data
(built first if missing), each agent applying its instance's fix with bash in /testbed, graded by the
harness in a fresh sandbox of the image. Reports first-use unpack time per image, how often each
image was unpacked, the cached boot of an image sandbox next to a host-root sandbox's (alternated in
this process, same fork server), and the disk each sandbox's private layer took.

    .venv/bin/python bench/swe_images.py [--jobs 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_service.devtools.local_service import local_service  # noqa: E402
from rollout_service.devtools.redis_server import free_port  # noqa: E402
from rollout_service.devtools.reference_server import ReferenceServerProcess  # noqa: E402
from rollout_service.devtools.tiny_model import build_tiny_tokenizer  # noqa: E402


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def build_images() -> dict[str, dict]:
    """The suite's SWE images (tests/swe_data, or ROLLOUT_SWE_DATA's rows), built if missing."""
    from tests.fixtures_swe import build_swe_images

    return build_swe_images()


def row_of(images: dict[str, dict], instance_id: str) -> dict:
    return dict(images[instance_id]["row"])


def boots(image: str, n: int) -> dict[str, object]:
    """Cached image-sandbox boots alternated with host-root boots (medians, ms)."""
    from rollout_service.sandbox import SandboxSpec, create_sandbox

    samples: dict[str, list[float]] = {"image": [], "host": []}
    for i in range(2 * n + 2):
        kind = "image" if i % 2 == 0 else "host"
        workspace = tempfile.mkdtemp()
        spec = SandboxSpec(f"bench-{i}", workspace, image=image if kind == "image" else None, tools=("bash",))
        box = create_sandbox("bwrap", spec)
        began = time.perf_counter()
        box.start()
        if i >= 2:  # the first of each warms the fork server and the cache
            samples[kind].append(time.perf_counter() - began)
        box.stop()
        os.rmdir(workspace)
    return {f"{kind}_boot_p50_ms": round(statistics.median(s) * 1000, 1) for kind, s in samples.items()}


def layer_disk(image: str, fix: str) -> int:
    """Bytes the private layer of a sandbox holds after the fix is applied (what a sandbox costs on disk)."""
    from rollout_service.images.cache import tree_bytes
    from rollout_service.sandbox import SandboxSpec, create_sandbox

    workspace = tempfile.mkdtemp()
    box = create_sandbox(
        "bwrap", SandboxSpec("bench-disk", workspace, image=image, tools=("bash",), workdir="/testbed")
    )
    box.start()
    try:
        box.execute("bash", {"command": f"git apply <<'EOF'\n{fix}\nEOF"}, 60)
        return tree_bytes(box._image.scratch / "upper")  # type: ignore[attr-defined]
    finally:
        box.stop()
        os.rmdir(workspace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()

    images = build_images()
    work = Path(tempfile.mkdtemp(prefix="bench-swe-"))
    cache = work / "image-cache"
    roots = ",".join(sorted({str(Path(e["layout"]).parent) for e in images.values()}))
    env = {"ROLLOUT_IMAGE_ROOTS": roots, "ROLLOUT_IMAGE_CACHE_DIR": str(cache), "ROLLOUT_SWE_EVAL_TIMEOUT_S": "900"}
    os.environ.update(env)
    tokenizer = build_tiny_tokenizer(work / "tokenizer")
    ids = sorted(images)
    episodes = []
    for instance_id in ids:
        row = row_of(images, instance_id)
        episodes.append(
            {
                "match": row["problem_statement"].strip().splitlines()[0][:60],
                "turns": [
                    tool_call("bash", command=f"git apply <<'EOF'\n{row['patch']}\nEOF\ngit status --short"),
                    tool_call("finish", answer="fixed"),
                ],
            }
        )
    (work / "script.json").write_text(json.dumps({"episodes": episodes}))
    server = ReferenceServerProcess(
        ["--script", str(work / "script.json"), "--tokenizer", str(tokenizer)],
        port=free_port(),
        log_path=work / "llm.log",
    ).start()
    result: dict[str, object] = {"jobs": args.jobs, "images": len(ids)}
    try:
        with local_service(work / "state", **env, ROLLOUT_EVAL_CONCURRENCY="2") as service, service.client() as client:
            client.add_backend(server.url, "vllm", "scripted", tokenizer=str(tokenizer))
            tasks = [
                {**row_of(images, ids[i % len(ids)]), "domain": "swe", "image": images[ids[i % len(ids)]]["image"]}
                for i in range(args.jobs)
            ]
            began = time.monotonic()
            job_ids = [client.submit(task, agent={"max_turns": 4}).job_ids[0] for task in tasks]
            views = client.wait(job_ids, timeout_s=3600)
            result["wall_s"] = round(time.monotonic() - began, 1)
            result["completed"] = sum(v.status.value == "completed" for v in views)
            result["resolved"] = sum(v.reward == 1.0 for v in views)
            result["failed"] = [v.error.message[:200] for v in views if v.error is not None][:5]
        entries = [json.loads(p.read_text()) for p in sorted((cache / "entries").glob("*/meta.json"))]
        result["unpacked_images"] = len(entries)
        result["first_use_unpack_s"] = {e["name"].rsplit(":", 1)[-1]: e["unpack_s"] for e in entries}
        result["image_bytes"] = {e["name"].rsplit(":", 1)[-1]: e["bytes"] for e in entries}
        flask = next(i for i in ids if "flask" in i)
        result |= boots(images[flask]["image"], 20)
        result["layer_bytes_after_fix"] = layer_disk(images[flask]["image"], row_of(images, flask)["patch"])
    finally:
        server.stop()
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
