"""A tiny OCI image without Python, built in a second from the host's bash, coreutils and git
(their shared libraries copied with them), packaged with umoci like any image."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

TINY_TOOLS = (
    "bash sh ls cat env id touch mkdir rm sleep git stat wc head tail base64 chmod readlink "
    "cp mv grep sed sort tr dirname basename chown ps kill timeout patch mount git-upload-pack"
).split()
TINY_ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", "IMAGE_VAR=from-image")
TINY_WORKDIR = "/data"


def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    return [word for line in out.splitlines() for word in line.split() if word.startswith("/")]


def build_tiny_image(
    directory: Path, tag: str = "tiny", extra_files: dict[str, str] | None = None, testbed: Path | None = None
) -> str:
    """An OCI layout at ``directory`` holding one image (``tag``); returns its ``oci:`` name."""
    layout, bundle = directory / "layout", directory / "bundle"
    if layout.exists() and f'"{tag}"' in (layout / "index.json").read_text():
        return f"oci:{layout}:{tag}"
    run = lambda *argv: subprocess.run(argv, check=True, capture_output=True)  # noqa: E731
    if not layout.exists():
        run("umoci", "init", "--layout", str(layout))
    run("umoci", "new", "--image", f"{layout}:{tag}")
    shutil.rmtree(bundle, ignore_errors=True)
    run("umoci", "unpack", "--rootless", "--image", f"{layout}:{tag}", str(bundle))
    root = bundle / "rootfs"
    for tool in [*TINY_TOOLS, "/usr/lib/git-core/git-upload-pack"]:
        found = shutil.which(tool)
        if found is None:
            continue
        for path in [found, *_libraries(found)]:
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                shutil.copy2(path, target, follow_symlinks=True)
    for name in ("tmp", "root", "etc", "data", "dev", "proc"):
        (root / name).mkdir(exist_ok=True)
    (root / "bin").mkdir(exist_ok=True)
    for shell in ("sh", "bash"):
        (root / "bin" / shell).symlink_to(f"/usr/bin/{shell}")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "data" / "file.txt").write_text("hello from the image\n")
    for name, text in (extra_files or {}).items():
        (root / name.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / name.lstrip("/")).write_text(text)
    if testbed is not None:
        shutil.copytree(testbed, root / "testbed", symlinks=True)
    run("umoci", "repack", "--image", f"{layout}:{tag}", str(bundle))
    config = [f"--config.env={e}" for e in TINY_ENV]
    run("umoci", "config", "--image", f"{layout}:{tag}", *config, f"--config.workingdir={TINY_WORKDIR}")
    shutil.rmtree(bundle)
    return f"oci:{layout}:{tag}"


@pytest.fixture(scope="session")
def tiny_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The ``oci:`` name of the tiny image (under a directory tests must add to ROLLOUT_IMAGE_ROOTS)."""
    return build_tiny_image(tmp_path_factory.mktemp("images"))


@pytest.fixture
def image_node(tiny_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process as a node whose image cache is a fresh directory (returned) and whose workers may
    read the tiny image's directory (ROLLOUT_IMAGE_ROOTS)."""
    from rollout_service.images import image_cache
    from rollout_service.settings import get_settings

    layout = tiny_image.split(":")[1]
    monkeypatch.setenv("ROLLOUT_IMAGE_ROOTS", str(Path(layout).parent))
    monkeypatch.setenv("ROLLOUT_IMAGE_CACHE_DIR", str(tmp_path / "image-cache"))
    get_settings.cache_clear()
    image_cache.cache_clear()
    yield tmp_path / "image-cache"
    get_settings.cache_clear()
    image_cache.cache_clear()
