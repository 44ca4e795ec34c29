"""A bwrap sandbox's root file system made from an image: the node's unpacked copy (read-only, shared
by every sandbox of the image) under a private writable layer (overlayfs, its upper directory
per sandbox: nothing is written back, nothing is copied), the image's files owned by the sandbox's
uid through an id-mapped mount, the image config's ``Env`` and ``WorkingDir``.

A repository in the image can be pinned (``SandboxSpec.pin_repo``): a layer made once per node
and commit holds a ``.git`` with the commit and its history alone (no other refs, reflogs or
objects: what came after the commit, the fix, is out of reach), over the image's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import uuid
from pathlib import Path

from rollout_service.errors import ImageError, SandboxError, TaskError
from rollout_service.images import Rootfs, image_cache, parse_image
from rollout_service.sandbox.base import INNER_SOCKET_DIR, INNER_WORKSPACE, SandboxSpec
from rollout_service.settings import get_settings

OPAQUE_XATTR = "trusted.overlay.opaque"
PINNED_HEAD_FILE = "rollout-pinned-head"  # in the pinned .git: the commit the repository was at
SAFE_GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c safe.directory='*'"
PIN_TIMEOUT_S = 900.0


class ImageRoot:
    """What one sandbox's root is made of, taken in ``prepare`` and given back in ``release``."""

    def __init__(self, rootfs: Rootfs, layers: list[Path], scratch: Path, hold_fd: int) -> None:
        self.rootfs = rootfs
        self.layers = layers  # above the image, the top one first
        self.scratch = scratch
        self._hold_fd = hold_fd

    @classmethod
    def prepare(cls, spec: SandboxSpec, sandbox_id: str) -> ImageRoot:
        assert spec.image is not None
        cache = image_cache()
        ref = parse_image(spec.image)
        for _ in range(3):  # held, it cannot be evicted; evicted just before, it is unpacked again
            rootfs = cache.resolve(ref)
            hold_fd = cache.hold(rootfs)
            if cache.is_unpacked(rootfs.digest):
                break
            cache.release(hold_fd)
        try:
            layers = [pinned_repo_layer(rootfs, *spec.pin_repo)] if spec.pin_repo else []
        except BaseException:
            cache.release(hold_fd)
            raise
        scratch = cache.root / "sandboxes" / sandbox_id
        try:
            for name in ("upper", "work", "root", *(f"lower{i}" for i in range(len(layers) + 1))):
                (scratch / name).mkdir(parents=True, exist_ok=True)
        except BaseException:
            cache.release(hold_fd)
            raise
        return cls(rootfs, layers, scratch, hold_fd)

    def release(self) -> None:
        from rollout_service.images.cache import remove_tree

        remove_tree(self.scratch)
        image_cache().release(self._hold_fd)

    def env(self, service_env: dict[str, str], spec_env: dict[str, str]) -> dict[str, str]:
        """The image's Env, then what every sandbox gets that the image does not set (never the
        host's PATH: the image's programs are what its PATH finds; nor LC_ALL: the image may lack
        that locale), then the job's (where ``$PATH`` stands for the image's)."""
        env = dict(item.split("=", 1) for item in self.rootfs.env if "=" in item)
        for key, value in service_env.items():
            if key not in env and key not in ("PATH", "LC_ALL"):
                env[key] = value
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        if env.get("HOME", "/tmp") == "/tmp":  # the service's default home is no image's
            env["HOME"] = "/root"
        env["ROLLOUT_WORKSPACE"] = INNER_WORKSPACE
        image_path = env["PATH"]
        env.update({key: value.replace("$PATH", image_path) for key, value in spec_env.items()})
        return env

    def workdir(self, spec: SandboxSpec) -> str:
        return spec.workdir or self.rootfs.workdir or INNER_WORKSPACE

    def mount_plan(
        self, spec: SandboxSpec, socket_dir: str, host_view: str, runtime: tuple[str, ...]
    ) -> list[list[str]]:
        """The forked init's mounts (``rollout_service.tools.zygote.apply_mounts``): the overlay as
        its new root, then what every sandbox has (fresh /tmp, /dev/shm and /run, /dev, /proc, the
        workspace, the socket directory, the service's runtime read-only for the action server),
        then the switch of root that leaves the host behind."""
        size = str(max(spec.memory_mb, 64) * 1024 * 1024)
        view = lambda path: host_view + os.path.realpath(path)  # noqa: E731
        lowers = [*self.layers, self.rootfs.path]
        plan: list[list[str]] = [["private", "/"]]
        for i, lower in enumerate(lowers):
            plan.append(["idmap-bind", view(str(lower)), view(str(self.scratch / f"lower{i}"))])
        options = "lowerdir={},upperdir={},workdir={}".format(
            ":".join(view(str(self.scratch / f"lower{i}")) for i in range(len(lowers))),
            view(str(self.scratch / "upper")),
            view(str(self.scratch / "work")),
        )
        root = view(str(self.scratch / "root"))
        plan.append(["overlay", options, root])
        plan += [["dir", root + "/dev"], ["rbind", "/dev", root + "/dev"]]
        plan += [["dir", root + "/tmp"], ["tmpfs", size, "1777", root + "/tmp"]]
        plan += [["dir", root + "/dev/shm"], ["tmpfs", size, "1777", root + "/dev/shm"]]
        plan += [["dir", root + "/run"], ["tmpfs", "1048576", "755", root + "/run"]]
        for path in [*runtime, *spec.read_only]:
            plan += [["dir", root + path], ["ro-bind", view(path), root + path]]
        plan += [["dir", root + INNER_SOCKET_DIR], ["bind", view(socket_dir), root + INNER_SOCKET_DIR]]
        plan += [["dir", root + INNER_WORKSPACE], ["bind", view(spec.workspace), root + INNER_WORKSPACE]]
        plan += [["dir", root + "/proc"], ["proc", root + "/proc"], ["devpts", root + "/dev/pts"]]
        plan.append(["root", root])
        return plan


def pinned_repo_layer(rootfs: Rootfs, repo_dir: str, commit: str) -> Path:
    """A layer whose ``<repo_dir>/.git`` holds ``commit`` and its history alone, checked out as
    the image has it; made once per node in a sandbox of the image itself (its own git, never
    the host's on the image's files)."""
    name = "pin-" + hashlib.sha256(f"{repo_dir}\0{commit}".encode()).hexdigest()[:24]
    return image_cache().derived_layer(rootfs, name, lambda layer: _build_pin(rootfs, repo_dir, commit, layer))


def _build_pin(rootfs: Rootfs, repo_dir: str, commit: str, layer: Path) -> None:
    from rollout_service.sandbox import create_sandbox

    work = layer / f"work-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    (work / "pin.sh").write_text(pin_script(repo_dir, commit))
    settings = get_settings()
    spec = SandboxSpec(
        job_id=f"pin-{uuid.uuid4().hex[:12]}",
        workspace=str(work),
        image=rootfs.name,
        tools=(),
        memory_mb=max(settings.sandbox_memory_mb, 4096),
        cpu_time_s=int(PIN_TIMEOUT_S),
        max_procs=settings.sandbox_max_procs,
        ttl_s=PIN_TIMEOUT_S + 60,
        script=("bash", f"{INNER_WORKSPACE}/pin.sh"),
        workdir=INNER_WORKSPACE,
    )
    code, output = create_sandbox("bwrap", spec, None).run(PIN_TIMEOUT_S)
    if code != 0:
        reasons = {
            3: f"the image {rootfs.name} has no git repository at {repo_dir}",
            4: f"task.base_commit {commit} is not a commit of the repository at {repo_dir} in {rootfs.name}",
            5: f"the repository at {repo_dir} in {rootfs.name} is not at task.base_commit {commit} (nor one "
            "commit above it, as SWE-bench's images are): an image's repository must be checked out at it",
        }
        error = TaskError if code in reasons else ImageError
        raise error(reasons.get(code or 0, f"pinning {repo_dir} at {commit} in {rootfs.name} failed: {output[-1500:]}"))
    target = layer / repo_dir.strip("/") / ".git"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(work / "git", target)
    for root, dirs, files in os.walk(layer):
        for entry in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(entry, 0, 0)
    os.setxattr(target, OPAQUE_XATTR, b"y")
    with contextlib.suppress(OSError):
        for leftover in work.iterdir():
            leftover.unlink()
        work.rmdir()


def pin_script(repo_dir: str, commit: str) -> str:
    """Copy the image's HEAD and its history alone from its repository into /workspace/git. HEAD is
    ``commit``, or (the official SWE-bench images: their setup ends with ``git commit --allow-empty
    -am SWE-bench``) a commit whose parent is ``commit``; its id goes to ``PINNED_HEAD_FILE``, what
    the agent's diff is taken against."""
    repo = shlex.quote(repo_dir)
    return f"""set -u
G="{SAFE_GIT}"
cd {repo} 2>/dev/null && $G rev-parse --git-dir >/dev/null 2>&1 || exit 3
sha=$($G rev-parse --verify --quiet "{commit}^{{commit}}") || exit 4
head=$($G rev-parse --verify --quiet HEAD) || exit 5
[ "$head" = "$sha" ] || [ "$($G rev-parse --verify --quiet "HEAD^")" = "$sha" ] || exit 5
branch=$($G symbolic-ref --quiet --short HEAD || echo main)
new=/workspace/git
set -e
$G init -q --bare "$new"
$G --git-dir="$new" -c protocol.version=2 fetch -q --update-shallow --no-tags --no-write-fetch-head {repo} "$head:refs/heads/$branch"
echo "$head" > "$new/{PINNED_HEAD_FILE}"
$G --git-dir="$new" symbolic-ref HEAD "refs/heads/$branch"
$G --git-dir="$new" config core.bare false
$G --git-dir="$new" config user.name rollout-agent
$G --git-dir="$new" config user.email agent@rollout.invalid
cp "$($G rev-parse --git-dir)/index" "$new/index" 2>/dev/null || $G --git-dir="$new" --work-tree={repo} read-tree "$head"
$G --git-dir="$new" --work-tree={repo} update-index -q --refresh >/dev/null 2>&1 || true
mkdir -p "$new/info"
cat "$($G rev-parse --git-dir)/info/exclude" > "$new/info/exclude" 2>/dev/null || true
printf '%s\\n' __pycache__/ '*.pyc' .pytest_cache/ '*.egg-info/' >> "$new/info/exclude"
$G --git-dir="$new" --work-tree={repo} ls-files --others --exclude-standard --directory | sed 's|^|/|' >> "$new/info/exclude"
$G --git-dir="$new" --work-tree={repo} status --porcelain >/dev/null
"""


def check_image_sandbox(spec: SandboxSpec, fork_server: bool) -> None:
    if spec.image is None:
        return
    if not fork_server:
        raise SandboxError(
            f"image {spec.image}: bwrap sandboxes from images are made by the fork server, which needs the "
            "workers to run as root with ROLLOUT_SANDBOX_FORK_SERVER=1 (or use ROLLOUT_SANDBOX=singularity)"
        )
