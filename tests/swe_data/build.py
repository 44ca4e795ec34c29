#!/usr/bin/env python3
"""Build SWE-bench-layout OCI images for SWE-bench instances, without Docker.

    python tests/swe_data/build.py --out DIR [--data DATA] [INSTANCE_ID ...]

For every instance directory ``DATA/<instance_id>/`` (or the ones named) this builds an
OCI image layout ``DIR/layout`` holding one tag per instance, named by the harness's rule
(``sweb.eval.x86_64.<id with __ -> _1776_>``), and prints one JSON line per instance:
``{"instance_id", "image": "oci:DIR/layout:TAG", "layout", "tag", ...}``.  DATA is
``--data``, else ``$ROLLOUT_SWE_DATA``, else ``tests/swe_data/ci`` (the instances
authored for CI).

The image is laid out like the official ``swebench/sweb.eval.x86_64.*`` images:

* a Debian bookworm root (``mmdebstrap --variant=minbase``), built once and reused;
* the repository at ``/testbed``, whose HEAD is exactly the row's ``base_commit``, plus
  one later commit (base + the gold patch) on ``refs/remotes/origin/<branch>``, a tag and
  a reflog entry -- the "future" that a published image can leak;
* the harness's Python environment in a venv at ``/opt/miniconda3/envs/testbed`` and
  ``/opt/miniconda3/bin/activate`` so that ``source /opt/miniconda3/bin/activate &&
  conda activate testbed`` works in bash.

An instance directory holds ``row.json`` (a row in the published format) and
``meta.json`` (sdist, environment, and the kind of repository):

* ``"kind": "authored"`` (tests/swe_data/ci): the repository is the PyPI sdist of a
  release committed as an "import" commit (fixed identity and date, so a fixed sha), less
  the paths ``meta["delete"]`` names, plus the files under ``files/`` (our own, e.g. a
  test launcher the sdist lacks); then ``bug.patch`` (a bug we introduce) committed on
  top, which is ``base_commit``.  The row's gold ``patch`` reverts the bug and its
  ``test_patch`` adds a test of ours; both are checked to apply at build time.
* ``"kind": "overlay"`` (the default; data kept outside this repository): the tree of a
  real commit recreated from an sdist plus ``overlay.tar.xz`` (the files that differ),
  checked against the raw commit object ``base_commit.obj`` (and ``parents.json``).

Results are cached under DIR by a hash of this file plus the instance's data, so a
second run is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE / "ci"
DATA = Path(os.environ.get("ROLLOUT_SWE_DATA") or DEFAULT_DATA)

SUITE = "bookworm"
BASE_PACKAGES = [
    "bash",
    "ca-certificates",
    "coreutils",
    "git",
    "patch",
    "procps",
    "python3",
    "python3-venv",
]
# Bump to force a rebuild of the base root (its recipe is the lines above).
BASE_RECIPE_VERSION = "1"
HOST_TOOLS = {
    "mmdebstrap": "mmdebstrap",
    "skopeo": "skopeo",
    "umoci": "umoci",
    "bwrap": "bubblewrap",
    "git": "git",
    "xz": "xz-utils",
}
IMAGE_ENV = [
    "PATH=/opt/miniconda3/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "DEBIAN_FRONTEND=noninteractive",
    "TZ=Etc/UTC",
]
ENV_DIR = "/opt/miniconda3/envs/testbed"
FUTURE_IDENTITY = ("SWE-bench fixture", "fixture@swe-bench.invalid")
AUTHORED_IDENTITY = ("rollout-service fixtures", "fixtures@rollout-service.invalid")

ACTIVATE_SCRIPT = r"""# Stand-in for miniconda's activate script: `source /opt/miniconda3/bin/activate &&
# conda activate testbed` works as in the official SWE-bench images.
export CONDA_EXE=/opt/miniconda3/bin/conda
export CONDA_ROOT=/opt/miniconda3
export CONDA_SHLVL="${CONDA_SHLVL:-0}"
conda() {
    case "$1" in
        activate)
            local name="${2:-base}"
            local prefix
            if [ "$name" = base ]; then
                prefix=/opt/miniconda3
            elif [ -d "$name" ]; then
                prefix="$name"
            else
                prefix="/opt/miniconda3/envs/$name"
            fi
            if [ "$prefix" != /opt/miniconda3 ]; then
                if [ ! -f "$prefix/bin/activate" ]; then
                    echo "EnvironmentNameNotFound: Could not find conda environment: $name" >&2
                    return 1
                fi
                if [ -n "${VIRTUAL_ENV:-}" ] && type deactivate >/dev/null 2>&1; then
                    deactivate
                fi
                VIRTUAL_ENV_DISABLE_PROMPT=1 . "$prefix/bin/activate"
            fi
            export CONDA_DEFAULT_ENV="$name"
            export CONDA_PREFIX="$prefix"
            export CONDA_SHLVL=$((CONDA_SHLVL + 1))
            ;;
        deactivate)
            if [ -n "${VIRTUAL_ENV:-}" ] && type deactivate >/dev/null 2>&1; then
                deactivate
            fi
            if [ "${CONDA_DEFAULT_ENV:-base}" != base ]; then
                export CONDA_DEFAULT_ENV=base
                export CONDA_PREFIX=/opt/miniconda3
            else
                unset CONDA_DEFAULT_ENV CONDA_PREFIX
            fi
            if [ "$CONDA_SHLVL" -gt 0 ]; then export CONDA_SHLVL=$((CONDA_SHLVL - 1)); fi
            ;;
        info|env)
            if [ "$1 ${2:-}" = "env list" ] || [ "$1 ${2:-}" = "info --envs" ]; then
                echo "# conda environments:"
                echo "base                     /opt/miniconda3"
                for d in /opt/miniconda3/envs/*/; do
                    d="${d%/}"; echo "$(basename "$d")                  $d"
                done
            else
                echo "conda stand-in: only activate, deactivate, env list" >&2; return 1
            fi
            ;;
        *)
            echo "conda stand-in: only activate, deactivate, env list" >&2
            return 1
            ;;
    esac
}
conda activate base
"""
CONDA_SCRIPT = """#!/bin/bash
# conda stand-in: `conda activate` needs `source /opt/miniconda3/bin/activate` first.
. /opt/miniconda3/bin/activate
conda "$@"
"""
GITCONFIG = """[user]
\temail = setup@swebench.config
\tname = SWE-bench
"""


class BuildError(RuntimeError):
    def __init__(self, step: str, message: str, log: Path | None = None):
        self.step, self.log = step, log
        tail = ""
        if log is not None and log.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        super().__init__(f"step {step!r} failed: {message}" + (f"\n--- log tail ({log}) ---\n{tail}" if tail else ""))


# ---------------------------------------------------------------------------- helpers


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def image_tag(instance_id: str) -> str:
    return f"sweb.eval.x86_64.{instance_id.replace('__', '_1776_')}".lower()


def instance_key(data_dir: Path) -> str:
    """A hash of this builder and of every file of the instance's data."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for p in sorted(q for q in data_dir.rglob("*") if q.is_file() and "__pycache__" not in q.parts):
        rel = p.relative_to(data_dir).as_posix()
        h.update(rel.encode() + b"\0" + (b"x" if os.access(p, os.X_OK) else b"-") + p.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def base_key() -> str:
    recipe = json.dumps([SUITE, sorted(BASE_PACKAGES), BASE_RECIPE_VERSION])
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


class Runner:
    """Runs commands, appending their output to a log file."""

    def __init__(self, log: Path):
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)

    def note(self, text: str) -> None:
        with open(self.log, "a") as f:
            f.write(text.rstrip("\n") + "\n")

    def run(
        self,
        step: str,
        cmd: list[str],
        *,
        cwd: Path | str | None = None,
        env: dict | None = None,
        input: bytes | None = None,
        capture: bool = False,
    ) -> bytes:
        self.note(f"$ {shlex.join(map(str, cmd))}")
        with open(self.log, "ab") as logf:
            proc = subprocess.run(
                [str(c) for c in cmd],
                cwd=cwd,
                env=env,
                input=input,
                stdout=subprocess.PIPE if capture else logf,
                stderr=logf,
            )
        if proc.returncode != 0:
            raise BuildError(step, f"{shlex.join(map(str, cmd))} exited {proc.returncode}", self.log)
        return proc.stdout or b""


def point_branch_as_cloned(dest: Path, repo: str, branch: str, commit: str) -> None:
    """``branch`` at ``commit`` and HEAD on it, with the remote, tracking and reflog a clone of
    ``repo`` from GitHub leaves."""
    url = f"https://github.com/{repo}.git"
    git(dest, "config", "remote.origin.url", url)
    git(dest, "config", "remote.origin.fetch", "+refs/heads/*:refs/remotes/origin/*")
    git(dest, "config", f"branch.{branch}.remote", "origin")
    git(dest, "config", f"branch.{branch}.merge", f"refs/heads/{branch}")
    git(dest, "update-ref", "--create-reflog", "-m", f"clone: from {url}", f"refs/heads/{branch}", commit)
    git(dest, "symbolic-ref", "HEAD", f"refs/heads/{branch}")


def index_whole_tree(dest: Path, branch: str) -> dict:
    """A new repository at ``dest`` whose index holds every file there byte for byte (no eol,
    ident or filter conversion); returns the git environment that uses that index."""
    env = {"GIT_INDEX_FILE": str(dest / ".git" / "index")}
    git(dest, "init", "-q", "-b", branch)
    attrs = dest / ".git" / "info" / "attributes"
    attrs.parent.mkdir(parents=True, exist_ok=True)
    attrs.write_text("* -text -ident -filter -eol\n")
    flags = ["-c", "core.autocrlf=false", "-c", "core.fileMode=true", "-c", "core.symlinks=true"]
    git(dest, *flags, "add", "-A", "-f", ".", env=env)
    return env


def git(repo: Path, *args: str, input: bytes | None = None, env: dict | None = None) -> bytes:
    full_env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", HOME=str(repo), **(env or {}))
    full_env.pop("GIT_DIR", None)
    if not (env and "GIT_INDEX_FILE" in env):
        full_env.pop("GIT_INDEX_FILE", None)
    proc = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, env=full_env)
    if proc.returncode != 0:
        raise BuildError("git", f"git {' '.join(args)}: {proc.stderr.decode(errors='replace')[-2000:]}")
    return proc.stdout


# ---------------------------------------------------------------------------- host tools

_apt_updated = False


def ensure_host_tools(runner: Runner) -> None:
    global _apt_updated
    missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise BuildError("host-tools", f"missing {missing} and not root to apt-get install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if not _apt_updated:
        runner.run("apt-get update", ["apt-get", "update"], env=env)
        _apt_updated = True
    runner.run("apt-get install", ["apt-get", "install", "-y", "--no-install-recommends", *missing], env=env)


# ---------------------------------------------------------------------------- base root


def build_base(out: Path, runner: Runner) -> Path:
    """The Debian root as a tarball, built once per base recipe."""
    d = out / "base" / base_key()
    tar = d / "rootfs.tar"
    if tar.exists():
        return tar
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "rootfs.tar.partial"
    tmp.unlink(missing_ok=True)
    runner.run(
        "mmdebstrap",
        [
            "mmdebstrap",
            "--variant=minbase",
            "--mode=root",
            "--format=tar",
            "--include=" + ",".join(BASE_PACKAGES),
            '--customize-hook=rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*_dists_*',
            SUITE,
            str(tmp),
        ],
    )
    tmp.rename(tar)
    return tar


def ensure_layout(out: Path, base_tar: Path, runner: Runner) -> tuple[Path, str]:
    """The OCI layout with the base root as a tag of its own (the first layer of every image)."""
    layout = out / "layout"
    base_tag = f"base-{base_key()}"
    if not (layout / "index.json").exists():
        runner.run("umoci init", ["umoci", "init", "--layout", layout])
    if base_tag in list_tags(layout):
        return layout, base_tag
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        root = Path(tmp) / "rootfs"
        root.mkdir()
        runner.run("extract base", ["tar", "-xf", base_tar, "-C", root, "--numeric-owner"])
        runner.run("umoci new", ["umoci", "new", "--image", f"{layout}:{base_tag}"])
        runner.run("umoci insert base", ["umoci", "insert", "--image", f"{layout}:{base_tag}", root, "/"])
        runner.run(
            "umoci config base",
            [
                "umoci",
                "config",
                "--image",
                f"{layout}:{base_tag}",
                "--os",
                "linux",
                "--architecture",
                "amd64",
                *sum((["--config.env", e] for e in IMAGE_ENV), []),
                "--config.cmd",
                "/bin/bash",
            ],
        )
    return layout, base_tag


def list_tags(layout: Path) -> list[str]:
    try:
        index = json.loads((layout / "index.json").read_text())
    except FileNotFoundError:
        return []
    return [m.get("annotations", {}).get("org.opencontainers.image.ref.name") for m in (index.get("manifests") or [])]


# ---------------------------------------------------------------------------- sdist + repository


def fetch_sdist(out: Path, meta: dict, runner: Runner) -> Path:
    sd = meta["sdist"]
    cache = out / "sdists"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / sd["filename"]
    if path.exists() and sha256_file(path) == sd["sha256"]:
        return path
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        runner.run(
            "pip download sdist",
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--disable-pip-version-check",
                "-d",
                tmp,
                f"{sd['name']}=={sd['version']}",
            ],
        )
        got = Path(tmp) / sd["filename"]
        if not got.exists():
            raise BuildError(
                "pip download sdist", f"{sd['filename']} not downloaded (got {os.listdir(tmp)})", runner.log
            )
        if sha256_file(got) != sd["sha256"]:
            raise BuildError("pip download sdist", f"sha256 of {sd['filename']} differs from meta.json", runner.log)
        shutil.move(got, path)
    return path


def _safe_extract(tf: tarfile.TarFile, dest: Path, strip_first: bool) -> None:
    for m in tf.getmembers():
        name = m.name
        if strip_first:
            parts = name.split("/", 1)
            if len(parts) < 2 or not parts[1]:
                continue
            name = parts[1]
        if name.startswith("/") or ".." in Path(name).parts:
            raise BuildError("extract", f"unsafe path in archive: {m.name}")
        m.name = name
        if m.islnk() and strip_first:
            m.linkname = m.linkname.split("/", 1)[1]
        if hasattr(tarfile, "tar_filter"):
            tf.extract(m, dest, set_attrs=True, numeric_owner=True, filter="tar")
        else:
            tf.extract(m, dest, set_attrs=True, numeric_owner=True)


def make_repo(data_dir: Path, sdist: Path, dest: Path, runner: Runner) -> dict:
    """The repository at the row's base_commit in dest, by the instance's kind."""
    kind = json.loads((data_dir / "meta.json").read_text()).get("kind", "overlay")
    if kind == "authored":
        return authored_repo(data_dir, sdist, dest, runner)
    if kind == "overlay":
        return reconstruct_repo(data_dir, sdist, dest, runner)
    raise BuildError("select", f"{data_dir}: unknown kind {kind!r} in meta.json")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _commit_env(meta_commit: dict) -> dict:
    name, email = AUTHORED_IDENTITY
    when = meta_commit["date"]
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": when,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": when,
    }


def authored_commits(data_dir: Path, sdist: Path, dest: Path, runner: Runner) -> dict:
    """The import commit (sdist - delete + files/) and base_commit (+ bug.patch) of an authored
    instance, in a new repository at dest whose work tree holds the import; returns their shas
    and trees.  Deterministic: fixed identity, dates and messages from meta.json."""
    meta = json.loads((data_dir / "meta.json").read_text())
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        _safe_extract(tf, dest, strip_first=True)
    for pattern in meta.get("delete", []):
        matches = sorted(dest.glob(pattern))
        if not matches:
            raise BuildError("import", f"meta.json delete: {pattern!r} matches nothing in {sdist.name}", runner.log)
        for p in matches:
            _remove(p)
    files = data_dir / "files"
    if files.is_dir():
        for src in sorted(files.rglob("*")):
            if src.is_file():
                target = dest / src.relative_to(files)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, target)
                target.chmod(0o755 if os.access(src, os.X_OK) else 0o644)
    env = index_whole_tree(dest, meta.get("branch", "main"))
    import_tree = git(dest, "write-tree", env=env).decode().strip()
    imp = meta["import"]
    import_commit = (
        git(dest, "commit-tree", import_tree, input=imp["message"].encode(), env=_commit_env(imp)).decode().strip()
    )
    bug_patch = (data_dir / "bug.patch").read_bytes()
    try:
        git(dest, "apply", "--cached", "-", input=bug_patch, env=env)
    except BuildError as e:
        raise BuildError("import", f"bug.patch does not apply to {sdist.name}: {e}", runner.log) from None
    base_tree = git(dest, "write-tree", env=env).decode().strip()
    if base_tree == import_tree:
        raise BuildError("import", "bug.patch changes nothing", runner.log)
    bug = meta["bug"]
    base = (
        git(dest, "commit-tree", base_tree, "-p", import_commit, input=bug["message"].encode(), env=_commit_env(bug))
        .decode()
        .strip()
    )
    (dest / ".git" / "info" / "attributes").unlink()
    return {"import_commit": import_commit, "import_tree": import_tree, "base_commit": base, "tree": base_tree}


def check_row_patches(dest: Path, row: dict, base_tree: str, gold_tree: str | None, runner: Runner) -> None:
    """The row's patch and test_patch apply to base_commit (and the patch gives gold_tree)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        for field in ("patch", "test_patch"):
            git(dest, "read-tree", base_tree, env=env)
            try:
                git(dest, "apply", "--cached", "-", input=row[field].encode(), env=env)
            except BuildError as e:
                raise BuildError(
                    "check patches", f"the row's {field} does not apply to base_commit: {e}", runner.log
                ) from None
            if field == "patch" and gold_tree is not None:
                got = git(dest, "write-tree", env=env).decode().strip()
                if got != gold_tree:
                    raise BuildError(
                        "check patches",
                        f"the row's patch does not revert bug.patch exactly (tree {got}, import tree {gold_tree})",
                        runner.log,
                    )


def authored_repo(data_dir: Path, sdist: Path, dest: Path, runner: Runner) -> dict:
    row = json.loads((data_dir / "row.json").read_text())
    meta = json.loads((data_dir / "meta.json").read_text())
    runner.note(f"# authored repository {row['repo']} from {sdist.name} + bug.patch")
    c = authored_commits(data_dir, sdist, dest, runner)
    base = c["base_commit"]
    if base != row["base_commit"]:
        raise BuildError(
            "import",
            f"the import + bug.patch commit is {base}, the row's base_commit is {row['base_commit']}",
            runner.log,
        )
    if row.get("environment_setup_commit") not in (c["import_commit"], base):
        raise BuildError(
            "import",
            f"environment_setup_commit {row.get('environment_setup_commit')} is neither "
            f"the import commit {c['import_commit']} nor base_commit",
            runner.log,
        )
    check_row_patches(dest, row, c["tree"], c["import_tree"], runner)
    branch = meta.get("branch", "main")
    point_branch_as_cloned(dest, row["repo"], branch, base)
    git(dest, "reset", "-q", "--hard", base)  # the work tree held the import: now base_commit
    future = make_future_commit(dest, row, base, c["tree"], branch)
    return {"base_commit": base, "tree": c["tree"], "parents": [c["import_commit"]], "branch": branch, **future}


def reconstruct_repo(data_dir: Path, sdist: Path, dest: Path, runner: Runner) -> dict:
    """Recreate the repository at exactly base_commit in dest; returns facts about it."""
    row = json.loads((data_dir / "row.json").read_text())
    meta = json.loads((data_dir / "meta.json").read_text())
    commit_obj = (data_dir / "base_commit.obj").read_bytes()
    base = row["base_commit"]
    tree = re.search(rb"^tree ([0-9a-f]{40})$", commit_obj, re.M).group(1).decode()
    parents = [p.decode() for p in re.findall(rb"^parent ([0-9a-f]{40})$", commit_obj, re.M)]
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    runner.note(f"# reconstructing {row['repo']}@{base} from {sdist.name} + overlay")
    with tarfile.open(sdist) as tf:
        _safe_extract(tf, dest, strip_first=True)
    for rel in meta.get("delete", []):
        p = dest / rel
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
    # Directories the sdist had and the tree lacks are gone once empty.
    for dirpath, _dirnames, _filenames in os.walk(dest, topdown=False):
        if dirpath != str(dest) and not os.listdir(dirpath):
            os.rmdir(dirpath)
    overlay = data_dir / "overlay.tar.xz"
    if overlay.exists():
        for p in meta.get("replace", []):  # paths whose type changes (e.g. file -> symlink)
            q = dest / p
            if q.is_symlink() or q.is_file():
                q.unlink()
        with tarfile.open(overlay) as tf:
            _safe_extract(tf, dest, strip_first=False)

    env = index_whole_tree(dest, meta.get("branch", "main"))
    got_tree = git(dest, "write-tree", env=env).decode().strip()
    if got_tree != tree:
        listing = git(dest, "ls-files", "-s", env=env).decode()
        (runner.log.parent / f"{row['instance_id']}.ls-files.txt").write_text(listing)
        raise BuildError(
            "reconstruct", f"tree {got_tree} != {tree} of {base} (index listing beside the log)", runner.log
        )
    got_commit = git(dest, "hash-object", "-t", "commit", "-w", "--stdin", input=commit_obj).decode().strip()
    if got_commit != base:
        raise BuildError("reconstruct", f"commit object hashes to {got_commit}, not {base}", runner.log)
    (dest / ".git" / "info" / "attributes").unlink()
    # The parent commit(s) too, so that `git show`/`git log -p` show the real last change, with
    # the parents as the shallow boundary (their own parents are not in the repository).
    parents_file = data_dir / "parents.json"
    have_parents = parents_file.exists()
    if have_parents:
        for psha, info in json.loads(parents_file.read_text()).items():
            write_parent(dest, tree, psha, info, runner)
    if parents:
        boundary = parents if have_parents else [base]
        (dest / ".git" / "shallow").write_text("".join(p + "\n" for p in sorted(boundary)))
    branch = meta.get("branch", "main")
    point_branch_as_cloned(dest, row["repo"], branch, base)
    git(dest, "read-tree", "HEAD", env=env)
    subprocess.run(["git", "-C", str(dest), "update-index", "-q", "--refresh"], capture_output=True)

    # One later commit: base + the gold patch, reachable from another ref, a tag and a reflog.
    future = make_future_commit(dest, row, base, tree, branch)
    return {"base_commit": base, "tree": tree, "parents": parents, "branch": branch, **future}


def write_parent(dest: Path, base_tree: str, psha: str, info: dict, runner: Runner) -> None:
    import base64

    obj = base64.b64decode(info["commit"])
    ptree = re.search(rb"^tree ([0-9a-f]{40})$", obj, re.M).group(1).decode()
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(dest, "read-tree", base_tree, env=env)
        lines = []
        for ch in info["changes"]:
            if ch["blob"] is None:  # added by base_commit
                lines.append(f"0 {'0' * 40}\t{ch['path']}")
            else:
                blob = (
                    git(
                        dest,
                        "hash-object",
                        "-t",
                        "blob",
                        "-w",
                        "--no-filters",
                        "--stdin",
                        input=base64.b64decode(ch["blob"]),
                    )
                    .decode()
                    .strip()
                )
                lines.append(f"{ch['mode']} {blob}\t{ch['path']}")
        if lines:
            git(dest, "update-index", "--index-info", input=("\n".join(lines) + "\n").encode(), env=env)
        got = git(dest, "write-tree", env=env).decode().strip()
    if got != ptree:
        raise BuildError("reconstruct", f"parent {psha}: tree {got} != {ptree}", runner.log)
    got = git(dest, "hash-object", "-t", "commit", "-w", "--stdin", input=obj).decode().strip()
    if got != psha:
        raise BuildError("reconstruct", f"parent commit object hashes to {got}, not {psha}", runner.log)


def make_future_commit(dest: Path, row: dict, base: str, tree: str, branch: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        idx = str(Path(tmp) / "index")
        env = {"GIT_INDEX_FILE": idx}
        git(dest, "read-tree", tree, env=env)
        git(dest, "apply", "--cached", "-", input=row["patch"].encode(), env=env)
        fixed_tree = git(dest, "write-tree", env=env).decode().strip()
    raw = git(dest, "cat-file", "commit", base)
    when = re.search(rb"^committer .* (\d+) [+-]\d{4}$", raw, re.M).group(1).decode()
    stamp = f"{int(when) + 86400} +0000"
    name, email = FUTURE_IDENTITY
    cenv = {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": stamp,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": stamp,
    }
    message = f"Fixed {row['instance_id']} (the row's gold patch).\n".encode()
    future = git(dest, "commit-tree", fixed_tree, "-p", base, input=message, env=cenv).decode().strip()
    remote_ref = f"refs/remotes/origin/{branch}"
    tag = f"fix-{row['instance_id'].split('-')[-1]}"
    git(dest, "update-ref", "--create-reflog", "-m", "fetch origin: fast-forward", remote_ref, future)
    git(dest, "update-ref", f"refs/tags/{tag}", future)
    return {"future_commit": future, "future_refs": [remote_ref, f"refs/tags/{tag}"]}


# ---------------------------------------------------------------------------- python environment


def host_pip_settings() -> tuple[dict, list[Path]]:
    """The host's pip configuration as PIP_* variables, and the local paths it refers to."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    settings: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^[\w-]+\.([\w-]+)='(.*)'$", line.strip())
        if m:
            settings["PIP_" + m.group(1).upper().replace("-", "_")] = m.group(2)
    for k, v in os.environ.items():
        if k.startswith("PIP_"):
            settings[k] = v
    settings.pop("PIP_TARGET", None)
    settings.pop("PIP_PREFIX", None)
    settings.pop("PIP_USER", None)
    paths: list[Path] = []
    for v in settings.values():
        for word in v.split():
            if word.startswith("file://"):
                word = word[len("file://") :].rstrip("/")
                if word.endswith("/simple"):  # a local index links to files beside it
                    word = word[: -len("/simple")]
            if word.startswith("/") and Path(word).exists():
                paths.append(Path(word))
    return settings, paths


def bwrap_cmd(root: Path, pip_cache: Path, binds: list[Path], argv: list[str], env: dict) -> list[str]:
    cmd = [
        "bwrap",
        "--bind",
        str(root),
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--die-with-parent",
        "--clearenv",
    ]
    resolv = Path("/etc/resolv.conf").resolve()
    if resolv.exists():
        cmd += ["--ro-bind", str(resolv), "/etc/resolv.conf"]
    if Path("/etc/hosts").exists():
        cmd += ["--ro-bind", "/etc/hosts", "/etc/hosts"]
    pip_cache.mkdir(parents=True, exist_ok=True)
    cmd += ["--bind", str(pip_cache), "/root/.cache/pip"]
    for p in binds:
        cmd += ["--ro-bind", str(p), str(p)]
    base_env = {
        "HOME": "/root",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "PIP_ROOT_USER_ACTION": "ignore",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
    }
    for k, v in {**base_env, **env}.items():
        cmd += ["--setenv", k, v]
    return cmd + argv


def install_environment(root: Path, data_dir: Path, out: Path, runner: Runner) -> None:
    meta = json.loads((data_dir / "meta.json").read_text())
    spec = meta["env"]
    settings, binds = host_pip_settings()
    # Certificates: the host's bundle (it may hold a CA that the package mirror needs).
    cert = settings.get("PIP_CERT")
    if cert and Path(cert).exists():
        binds.append(Path(cert))
    binds = sorted(set(binds))
    work = root / "tmp-build"
    work.mkdir(exist_ok=True)
    if (data_dir / "requirements.txt").exists():
        shutil.copy(data_dir / "requirements.txt", work / "requirements.txt")
    if (data_dir / "constraints.txt").exists():
        # The versions this instance was verified with (the harness leaves most unpinned).
        shutil.copy(data_dir / "constraints.txt", work / "constraints.txt")
        settings["PIP_CONSTRAINT"] = " ".join(
            filter(None, [settings.get("PIP_CONSTRAINT"), "/tmp-build/constraints.txt"])
        )
    script = ["set -ex", f"python3 -m venv {ENV_DIR}", f". {ENV_DIR}/bin/activate", "cd /testbed"]
    for cmd in spec.get("pre_install", []):
        script.append(cmd)
    if (data_dir / "requirements.txt").exists():
        script.append("python -m pip install -r /tmp-build/requirements.txt")
    if spec.get("pip_packages"):
        script.append("python -m pip install " + " ".join(shlex.quote(p) for p in spec["pip_packages"]))
    install_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.get("install_env", {}).items())
    script.append((install_env + " " if install_env else "") + spec["install"])
    script.append("python -m pip list --format=freeze > /tmp-build/pip-freeze.txt")
    (work / "setup.sh").write_text("\n".join(script) + "\n")
    runner.run(
        "install environment", bwrap_cmd(root, out / "pip-cache", binds, ["bash", "/tmp-build/setup.sh"], settings)
    )
    runner.note("# pip freeze:\n" + (work / "pip-freeze.txt").read_text())
    shutil.rmtree(work)


def write_conda_shims(staging: Path) -> None:
    bindir = staging / "opt/miniconda3/bin"
    bindir.mkdir(parents=True, exist_ok=True)
    (bindir / "activate").write_text(ACTIVATE_SCRIPT)
    (bindir / "conda").write_text(CONDA_SCRIPT)
    for name in ("activate", "conda"):
        (bindir / name).chmod(0o755)


# ---------------------------------------------------------------------------- one instance


def build_instance(
    instance_id: str, data_dir: Path, out: Path, base_tar: Path, layout: Path, base_tag: str, force: bool = False
) -> dict:
    key = instance_key(data_dir)
    tag = image_tag(instance_id)
    stamp_path = out / "stamps" / f"{instance_id}.json"
    if not force and stamp_path.exists():
        stamp = json.loads(stamp_path.read_text())
        if stamp.get("key") == key and tag in list_tags(layout):
            return {**stamp["result"], "cached": True}
    runner = Runner(out / "logs" / f"{instance_id}.log")
    runner.log.write_text("")
    t0 = time.monotonic()
    meta = json.loads((data_dir / "meta.json").read_text())
    sdist = fetch_sdist(out, meta, runner)
    work = out / "work" / instance_id
    if work.exists():
        shutil.rmtree(work)
    root = work / "rootfs"
    root.mkdir(parents=True)
    try:
        runner.run("extract base", ["tar", "-xf", base_tar, "-C", root, "--numeric-owner"])
        facts = make_repo(data_dir, sdist, root / "testbed", runner)
        write_conda_shims(root)
        (root / "root/.gitconfig").write_text(GITCONFIG)
        install_environment(root, data_dir, out, runner)
        # Installing must leave the tracked files as they were.
        status = subprocess.run(
            ["git", "-C", str(root / "testbed"), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
        if status.stdout.strip():
            raise BuildError("install environment", f"tracked files changed:\n{status.stdout[:2000]}", runner.log)
        # The instance layer: only what the instance adds to the base root.
        staging = work / "layer"
        staging.mkdir(mode=0o755)
        (staging / "opt").mkdir(mode=0o755)
        (staging / "root").mkdir(mode=0o700)
        os.rename(root / "opt/miniconda3", staging / "opt/miniconda3")
        os.rename(root / "testbed", staging / "testbed")
        shutil.copy2(root / "root/.gitconfig", staging / "root/.gitconfig")
        for p in (staging / "opt", staging / "root"):
            shutil.copystat(root / p.name, p)
        if tag in list_tags(layout):
            runner.run("umoci rm", ["umoci", "rm", "--image", f"{layout}:{tag}"])
        runner.run(
            "umoci config",
            [
                "umoci",
                "config",
                "--image",
                f"{layout}:{base_tag}",
                "--tag",
                tag,
                *sum((["--config.env", e] for e in IMAGE_ENV), []),
                "--config.workingdir",
                "/testbed",
                "--config.cmd",
                "/bin/bash",
                "--config.label",
                f"swebench.instance_id={instance_id}",
                "--config.label",
                f"swebench.base_commit={facts['base_commit']}",
            ],
        )
        runner.run("umoci insert", ["umoci", "insert", "--image", f"{layout}:{tag}", staging, "/"])
        runner.run("umoci gc", ["umoci", "gc", "--layout", layout])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "instance_id": instance_id,
        "image": f"oci:{layout}:{tag}",
        "layout": str(layout),
        "tag": tag,
        "base_commit": facts["base_commit"],
        "future_commit": facts["future_commit"],
        "future_refs": facts["future_refs"],
        "branch": facts["branch"],
        "parents": facts["parents"],
        "key": key,
        "build_seconds": round(time.monotonic() - t0, 1),
    }
    stamp_path.parent.mkdir(parents=True, exist_ok=True)
    stamp_path.write_text(json.dumps({"key": key, "result": result}, indent=1))
    return {**result, "cached": False}


def available_instances() -> list[str]:
    return sorted(p.name for p in DATA.iterdir() if (p / "row.json").exists() and (p / "meta.json").exists())


@contextlib.contextmanager
def locked(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(out: Path, instances: list[str], force: bool = False) -> list[dict]:
    out = out.resolve()
    results = []
    with locked(out):
        runner = Runner(out / "logs" / "base.log")
        ensure_host_tools(runner)
        base_tar = build_base(out, runner)
        layout, base_tag = ensure_layout(out, base_tar, runner)
        for iid in instances:
            data_dir = DATA / iid
            if not (data_dir / "row.json").exists():
                raise BuildError("select", f"no data for {iid} in {DATA}")
            result = build_instance(iid, data_dir, out, base_tar, layout, base_tag, force=force)
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="cache / output directory")
    p.add_argument("--force", action="store_true", help="rebuild the instances even if cached")
    p.add_argument(
        "--data", type=Path, help="instance data directory (default: $ROLLOUT_SWE_DATA, else tests/swe_data/ci)"
    )
    p.add_argument("instances", nargs="*", help="instance ids (default: all in the data directory)")
    args = p.parse_args(argv)
    if args.data:
        global DATA
        DATA = args.data.resolve()
    try:
        build(args.out, args.instances or available_instances(), force=args.force)
    except BuildError as e:
        print(json.dumps({"error": str(e), "step": e.step, "log": str(e.log) if e.log else None}), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
