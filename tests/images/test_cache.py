"""The node's image cache with real skopeo and umoci: names, digests, one unpack per digest,
eviction, start admission, and what bad images do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from rollout_service.errors import ImageError, ValidationError
from rollout_service.images import ImageCache, image_cache, instance_image_name, parse_image, resolve
from tests.fixtures_images import TINY_WORKDIR, build_tiny_image


def layout_dir(image: str) -> Path:
    return Path(image.split(":")[1])


def test_an_oci_layout_resolves_to_its_root_file_system_with_the_config_s_env_and_working_dir(image_node, tiny_image):
    rootfs = resolve(tiny_image)
    assert (rootfs.path / "data" / "file.txt").read_text() == "hello from the image\n"
    assert "IMAGE_VAR=from-image" in rootfs.env and rootfs.workdir == TINY_WORKDIR
    assert rootfs.path.is_relative_to(image_node)


def test_the_same_image_by_another_transport_is_the_same_cache_entry(image_node, tiny_image):
    archive = layout_dir(tiny_image).parent / "tiny.tar"
    subprocess.run(["skopeo", "copy", "-q", tiny_image, f"oci-archive:{archive}:tiny"], check=True)
    assert resolve(f"oci-archive:{archive}:tiny").path == resolve(tiny_image).path
    docker_archive = layout_dir(tiny_image).parent / "tiny-docker.tar"
    subprocess.run(["skopeo", "copy", "-q", tiny_image, f"docker-archive:{docker_archive}:tiny:latest"], check=True)
    assert (resolve(f"docker-archive:{docker_archive}").path / "data" / "file.txt").exists()


def _resolve_in_another_process(image: str) -> tuple[str, float]:
    from rollout_service.images import resolve as resolve_here

    rootfs = resolve_here(image)
    return str(rootfs.path), json.loads((rootfs.entry / "meta.json").read_text())["unpacked_at"]


def test_processes_that_use_an_image_first_at_once_unpack_it_once(image_node, tiny_image, tmp_path, monkeypatch):
    calls = tmp_path / "skopeo-copies"
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "skopeo").write_text(
        f'#!/bin/sh\n[ "$1" = copy ] && echo copy >> {calls}\nexec {shutil.which("skopeo")} "$@"\n'
    )
    (shim / "skopeo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    with ProcessPoolExecutor(4) as pool:
        results = list(pool.map(_resolve_in_another_process, [tiny_image] * 8))
    assert len({path for path, _ in results}) == 1 and len({when for _, when in results}) == 1
    assert calls.read_text().split() == ["copy"]
    assert not list((image_node / "tmp").iterdir())


def test_least_recently_used_images_go_past_the_size_cap_but_not_one_in_use(tiny_image, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_IMAGE_ROOTS", str(tmp_path))
    images = [build_tiny_image(tmp_path / f"image{i}", extra_files={"/id": str(i)}) for i in range(3)]
    cache = ImageCache(tmp_path / "cache", max_bytes=10**12)
    roots = [cache.resolve(parse_image(image)) for image in images]
    for age, rootfs in enumerate(roots):  # image0 least recently used
        os.utime(rootfs.entry / "last-used", (time.time() - 100 + age, time.time() - 100 + age))
    held = cache.hold(roots[0])
    cache.max_bytes = 1
    evicted = cache.evict()
    assert evicted == [roots[1].digest, roots[2].digest]
    assert roots[0].path.exists() and not roots[1].path.exists()
    cache.release(held)
    assert cache.evict() == [roots[0].digest]


def test_start_admission_lets_a_set_number_of_starts_of_one_image_through_at_once(tmp_path):
    cache = ImageCache(tmp_path, max_bytes=10**9, starts_per_image=2)
    inside, most = [0], [0]
    lock = threading.Lock()

    def start() -> None:
        with cache.start_slot("sha256:" + "a" * 64):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=start) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most[0] == 2


def test_a_tag_the_layout_does_not_have_is_an_image_error_naming_the_tags_it_has(image_node, tiny_image):
    with pytest.raises(ImageError, match=r"no tag 'missing' \(its tags: tiny\)"):
        resolve(tiny_image.rsplit(":", 1)[0] + ":missing")


def test_a_corrupt_layer_is_an_image_error_and_leaves_nothing_in_the_cache(image_node, tiny_image, tmp_path):
    copy = tmp_path / "corrupt"
    shutil.copytree(layout_dir(tiny_image), copy)
    manifest_digest = json.loads((copy / "index.json").read_text())["manifests"][0]["digest"].split(":")[1]
    manifest = json.loads((copy / "blobs" / "sha256" / manifest_digest).read_text())
    layer = copy / "blobs" / "sha256" / manifest["layers"][0]["digest"].split(":")[1]
    layer.chmod(0o644)
    layer.write_bytes(layer.read_bytes()[:-100] + b"x" * 100)
    os.environ["ROLLOUT_IMAGE_ROOTS"] += f",{tmp_path}"
    from rollout_service.settings import get_settings

    get_settings.cache_clear()
    with pytest.raises(ImageError, match=r"(?i)fetching oci:.*corrupt.*failed: .*digest did not match"):
        resolve(f"oci:{copy}:tiny")
    assert not (image_node / "entries").exists() or not list((image_node / "entries").iterdir())
    assert not list((image_node / "tmp").iterdir())


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ftp://example.com/x", "names no supported image transport"),
        ("docker://Upper/Case", "not a valid image name"),
        ("docker://busybox@sha256:1234", "not a sha256:<64 hex digits> digest"),
        ("oci:relative/dir:tag", "must be absolute"),
        ("oci:/etc:tag", "outside the directories images may be read from"),
        ("docker-archive:/etc/passwd", "ROLLOUT_IMAGE_ROOTS"),
        ("", "non-empty string"),
    ],
)
def test_a_bad_image_name_is_a_validation_error_naming_the_field(image_node, name, message):
    with pytest.raises(ValidationError, match=message) as raised:
        parse_image(name, "task.image")
    assert "task.image" in str(raised.value)


def test_a_symlink_out_of_the_image_roots_is_refused(image_node, tiny_image):
    link = layout_dir(tiny_image).parent / "escape"
    link.symlink_to("/etc")
    with pytest.raises(ValidationError, match="resolved: /etc"):
        parse_image(f"oci:{link}:x")


def test_a_swe_bench_instance_names_its_image_as_the_harness_does():
    template = "docker://swebench/sweb.eval.x86_64.{instance_id}:latest"
    assert (
        instance_image_name(template, "django__django-11099")
        == "docker://swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    assert parse_image(instance_image_name(template, "Sympy__sympy-20590")).transport == "docker"


def test_the_cache_is_one_per_process_from_the_settings(image_node):
    assert image_cache() is image_cache() and image_cache().root == image_node
