"""A node's image cache: every image fetched (skopeo) and unpacked (umoci, rootless) once per
manifest digest into a root file system that sandboxes use read-only, under a size cap with
least-recently-used eviction. Safe under concurrent first use, across the node's processes: one
unpacks while the others wait on its lock.

Layout under the cache directory::

    entries/<hex>/rootfs          the image's root file system (never written after the unpack)
    entries/<hex>/meta.json       digest, name, Env, WorkingDir, size, when unpacked
    entries/<hex>/last-used       its mtime: when a sandbox last started from it
    entries/<hex>/in-use          a shared lock held by each sandbox running on it (eviction skips it)
    entries/<hex>/layers/<name>   layers derived from it on this node (``derived_layer``)
    locks/<hex>.lock              held while the entry (or one of its layers) is made
    starts/<hex>.<slot>           start admission (``start_slot``)
    tmp/                          downloads and unpacks in progress
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_service.errors import ImageError
from rollout_service.images.refs import ImageRef

STAGING_TAG = "image"
OUTPUT_TAIL_CHARS = 1500


@dataclass(frozen=True)
class Rootfs:
    """An unpacked image: its root file system and what its config says a process starts with."""

    digest: str
    name: str
    path: Path
    env: tuple[str, ...]  # "KEY=value", the image config's Env
    workdir: str  # the image config's WorkingDir ("" when it has none)

    @property
    def entry(self) -> Path:
        return self.path.parent


def _tail(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return text.strip()[-OUTPUT_TAIL_CHARS:]


def _wait_for_lock(fd: int, mode: int = fcntl.LOCK_EX) -> None:
    """``flock`` without blocking the process: a green worker's other episodes go on while it waits
    (for another process's unpack, which may take minutes)."""
    pause = 0.01
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(pause)
            pause = min(pause * 2, 0.5)


@contextlib.contextmanager
def _flock(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        _wait_for_lock(fd, mode)
        yield fd
    finally:
        os.close(fd)


def image_config(layout: Path) -> dict[str, Any]:
    """The ``config`` object (Env, WorkingDir, ...) of the one image in an OCI layout skopeo wrote."""

    def blob(digest: str) -> dict[str, Any]:
        algorithm, _, hexdigest = digest.partition(":")
        return dict(json.loads((layout / "blobs" / algorithm / hexdigest).read_text()))

    manifest = blob(json.loads((layout / "index.json").read_text())["manifests"][0]["digest"])
    return dict(blob(manifest["config"]["digest"]).get("config") or {})


def tree_bytes(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def remove_tree(path: Path) -> None:
    """Remove ``path`` even where an image left directories without write permission."""

    def writable_then_retry(function: Any, failed: str, _: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            function(failed)

    shutil.rmtree(path, onerror=writable_then_retry)


class ImageCache:
    def __init__(self, root: Path, max_bytes: int, starts_per_image: int = 4, timeout_s: float = 1800.0) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.starts_per_image = max(starts_per_image, 1)
        self.timeout_s = timeout_s
        self._digests: dict[tuple[str, int, int], str] = {}

    # ---------------------------------------------------------------- resolving
    def resolve(self, ref: ImageRef) -> Rootfs:
        """``ref``'s root file system on this node, fetched and unpacked first if it is not here."""
        digest = self.digest(ref)
        entry = self._entry(digest)
        if not self.is_unpacked(digest):
            with _flock(self.root / "locks" / f"{digest.split(':')[-1]}.lock"):
                if not self.is_unpacked(digest):
                    self._unpack(ref, digest, entry)
            self.evict(keep={digest})
        (entry / "last-used").touch()
        return self._load(entry)

    def digest(self, ref: ImageRef) -> str:
        """The manifest digest ``ref`` names now (for a local file: cached by its size and mtime)."""
        if ref.transport == "sif":
            raise ImageError(f"{ref.name} is a Singularity image: run it with ROLLOUT_SANDBOX=singularity")
        if ref.pinned_digest:
            return ref.pinned_digest
        if ref.transport == "oci":
            return self._layout_digest(ref)
        key = (ref.name, *self._stamp(ref.location))
        if key not in self._digests:
            raw = self._run(["skopeo", "inspect", "--raw", ref.name], f"reading the manifest of {ref.name}")
            self._digests[key] = "sha256:" + hashlib.sha256(raw).hexdigest()
        return self._digests[key]

    @staticmethod
    def _stamp(location: str) -> tuple[int, int]:
        try:
            info = os.stat(location)
        except OSError:
            return (0, 0)  # a registry reference: looked up once per process (`images pull` refreshes)
        return (info.st_size, info.st_mtime_ns)

    @staticmethod
    def _layout_digest(ref: ImageRef) -> str:
        index_path = Path(ref.location) / "index.json"
        try:
            manifests = json.loads(index_path.read_text()).get("manifests", [])
        except FileNotFoundError:
            raise ImageError(f"{ref.name}: {ref.location} is not an OCI image layout (it has no index.json)") from None
        except (OSError, ValueError) as exc:
            raise ImageError(f"{ref.name}: the layout's index.json cannot be read: {exc}") from None
        named = {m.get("annotations", {}).get("org.opencontainers.image.ref.name"): m for m in manifests}
        if ref.tag:
            found = named.get(ref.tag)
        else:
            found = manifests[0] if len(manifests) == 1 else None
        if found is None or not isinstance(found.get("digest"), str):
            tags = ", ".join(sorted(str(t) for t in named if t)) or "none"
            what = f"has no tag {ref.tag!r}" if ref.tag else f"holds {len(manifests)} images: name one with :TAG"
            raise ImageError(f"{ref.name}: the layout {what} (its tags: {tags})")
        return str(found["digest"])

    def is_unpacked(self, digest: str) -> bool:
        """Whether this node has the image of ``digest`` (an entry is complete once it has its meta.json)."""
        return (self._entry(digest) / "meta.json").exists()

    def _entry(self, digest: str) -> Path:
        return self.root / "entries" / digest.split(":")[-1]

    @staticmethod
    def _load(entry: Path) -> Rootfs:
        meta = json.loads((entry / "meta.json").read_text())
        return Rootfs(meta["digest"], meta["name"], entry / "rootfs", tuple(meta["env"]), meta["workdir"])

    def _unpack(self, ref: ImageRef, digest: str, entry: Path) -> None:
        work = self.root / "tmp" / f"{digest.split(':')[-1][:16]}-{uuid.uuid4().hex[:8]}"
        work.mkdir(parents=True)
        began = time.monotonic()
        try:
            layout = work / "layout"
            self._run(["skopeo", "copy", "--quiet", ref.name, f"oci:{layout}:{STAGING_TAG}"], f"fetching {ref.name}")
            bundle = work / "bundle"
            bundle.mkdir()
            self._run(  # raw: the root file system alone, no runtime bundle and no mtree of every file
                ["umoci", "raw", "unpack", "--rootless", "--image", f"{layout}:{STAGING_TAG}", str(bundle / "rootfs")],
                f"unpacking {ref.name}",
            )
            config = image_config(layout)
            meta = {
                "digest": digest,
                "name": ref.name,
                "env": list(config.get("Env") or []),
                "workdir": config.get("WorkingDir") if config.get("WorkingDir") not in (None, "/") else "",
                "bytes": tree_bytes(bundle / "rootfs"),
                "unpack_s": round(time.monotonic() - began, 3),
                "unpacked_at": time.time(),
            }
            (bundle / "meta.json").write_text(json.dumps(meta))
            entry.parent.mkdir(parents=True, exist_ok=True)
            os.rename(bundle, entry)
        finally:
            remove_tree(work)

    def _run(self, argv: list[str], what: str) -> bytes:
        if shutil.which(argv[0]) is None:
            raise ImageError(f"{what} needs {argv[0]}, which is not installed (apt-get install {argv[0]})")
        try:
            done = subprocess.run(argv, capture_output=True, timeout=self.timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ImageError(f"{what} took more than {self.timeout_s:g} s (ROLLOUT_IMAGE_PULL_TIMEOUT_S)") from None
        if done.returncode != 0:
            raise ImageError(f"{what} failed: {_tail(done.stderr) or _tail(done.stdout)}")
        return done.stdout

    # ---------------------------------------------------------------- use
    def hold(self, rootfs: Rootfs) -> int:
        """A shared lock on the entry for a sandbox's life (``release`` it): eviction leaves it."""
        fd = os.open(rootfs.entry / "in-use", os.O_CREAT | os.O_RDONLY | os.O_CLOEXEC, 0o600)
        _wait_for_lock(fd, fcntl.LOCK_SH)
        return fd

    @staticmethod
    def release(fd: int) -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    @contextlib.contextmanager
    def start_slot(self, digest: str) -> Iterator[None]:
        """One of ``starts_per_image`` turns to start a sandbox of this image on this node."""
        slots = self.root / "starts"
        slots.mkdir(parents=True, exist_ok=True)
        hexdigest = digest.split(":")[-1][:16]
        fds = [
            os.open(slots / f"{hexdigest}.{i}", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            for i in range(self.starts_per_image)
        ]
        try:
            pause = 0.01
            while not any(_try_lock(fd) for fd in fds):
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
            yield
        finally:
            for fd in fds:
                os.close(fd)

    def derived_layer(self, rootfs: Rootfs, name: str, build: Callable[[Path], None]) -> Path:
        """A directory derived from ``rootfs`` once on this node (``build`` fills a new directory),
        kept with the entry and evicted with it."""
        layer = rootfs.entry / "layers" / name
        if layer.exists():
            return layer
        with _flock(self.root / "locks" / f"{rootfs.digest.split(':')[-1]}.lock"):
            if layer.exists():
                return layer
            work = self.root / "tmp" / f"layer-{uuid.uuid4().hex[:12]}"
            work.mkdir(parents=True)
            try:
                build(work)
                layer.parent.mkdir(parents=True, exist_ok=True)
                os.rename(work, layer)
            finally:
                if work.exists():
                    remove_tree(work)
        return layer

    # ---------------------------------------------------------------- housekeeping
    def entries(self) -> list[dict[str, Any]]:
        found = []
        for entry in sorted((self.root / "entries").glob("*")):
            with contextlib.suppress(OSError, ValueError):
                meta = json.loads((entry / "meta.json").read_text())
                used = entry / "last-used"
                meta["last_used"] = used.stat().st_mtime if used.exists() else meta["unpacked_at"]
                meta["path"] = str(entry / "rootfs")
                found.append(meta)
        return found

    def evict(self, keep: Collection[str] = ()) -> list[str]:
        """Remove least recently used entries not in use until the cache fits ``max_bytes``."""
        entries = sorted(self.entries(), key=lambda m: m["last_used"])
        total = sum(int(m["bytes"]) for m in entries)
        removed = []
        for meta in entries:
            if total <= self.max_bytes:
                break
            if meta["digest"] in keep:
                continue
            entry = self._entry(meta["digest"])
            fd = os.open(entry / "in-use", os.O_CREAT | os.O_RDONLY | os.O_CLOEXEC, 0o600)
            try:
                if not _try_lock(fd):
                    continue
                trash = self.root / "tmp" / f"evicted-{uuid.uuid4().hex[:12]}"
                trash.parent.mkdir(parents=True, exist_ok=True)
                os.rename(entry, trash)
            finally:
                os.close(fd)
            remove_tree(trash)
            total -= int(meta["bytes"])
            removed.append(meta["digest"])
        return removed


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
