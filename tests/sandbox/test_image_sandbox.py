"""bwrap sandboxes made from an image, with real bubblewrap, skopeo and umoci: the image's root
and tools, a private writable layer, the image config, a pinned repository, and what fails how."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from rollout_service.errors import SandboxError, TaskError
from rollout_service.images import resolve
from rollout_service.sandbox import SandboxSpec, create_sandbox
from rollout_service.sandbox.base import ServerSandbox
from rollout_service.settings import get_settings
from tests.fixtures_images import build_tiny_image


def bash(sandbox: ServerSandbox, command: str) -> str:
    observation = sandbox.execute("bash", {"command": command}, 30)
    return str(observation["output"])


def image_box(image: str, workspace: Path, **spec: object) -> ServerSandbox:
    workspace.mkdir(exist_ok=True)
    return create_sandbox(
        "bwrap",
        SandboxSpec(f"job-{uuid.uuid4().hex[:6]}", str(workspace), image=image, tools=("bash", "editor"), **spec),
    )  # type: ignore[arg-type]


def test_a_sandbox_from_an_image_without_python_runs_the_image_s_bash_in_its_working_dir_with_its_env(
    image_node, tiny_image, tmp_path
):
    with image_box(tiny_image, tmp_path / "ws") as box:
        assert bash(box, "pwd") == "/data"
        assert bash(box, "echo $IMAGE_VAR:$PATH") == "from-image:/usr/local/bin:/usr/bin:/bin"
        assert bash(box, "cat file.txt") == "hello from the image"
        assert "command not found" in bash(box, "python3 -c 'print(1)'")
        assert bash(box, "ls /etc") == "passwd"  # the image's /etc, not the host's


def test_what_a_sandbox_writes_stays_in_its_own_layer(image_node, tiny_image, tmp_path):
    with image_box(tiny_image, tmp_path / "a") as first, image_box(tiny_image, tmp_path / "b") as second:
        assert bash(first, "echo changed > file.txt && rm -f /usr/bin/sleep && cat file.txt") == "changed"
        assert bash(second, "cat file.txt && ls /usr/bin/sleep") == "hello from the image\n/usr/bin/sleep"
    rootfs = resolve(tiny_image)
    assert (rootfs.path / "data" / "file.txt").read_text() == "hello from the image\n"
    assert not list((image_node / "sandboxes").iterdir())


def test_the_image_s_files_belong_to_the_sandbox_s_own_uid_which_is_not_root(image_node, tiny_image, tmp_path):
    with image_box(tiny_image, tmp_path / "ws") as box:
        uid = bash(box, "id -u")
        assert uid != "0" and bash(box, "stat -c %u /data/file.txt /usr/bin/bash") == f"{uid}\n{uid}"
        assert bash(box, "mkdir -p /opt/new && echo ok > /opt/new/f && cat /opt/new/f") == "ok"
        assert "Operation not permitted" in bash(box, "chown 0 /data/file.txt 2>&1")


def test_the_workspace_is_bound_and_the_host_is_not_there(image_node, tiny_image, tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "note").write_text("from the host")
    with image_box(tiny_image, tmp_path / "ws") as box:
        assert bash(box, "cat /workspace/note") == "from the host"
        assert bash(box, f"ls {get_settings().state_path} 2>&1; ls /home 2>&1 | head -1").count("No such file") == 2


def test_a_one_shot_script_runs_in_the_image(image_node, tiny_image, tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "grade.sh").write_text("cd /data && cat file.txt && echo $IMAGE_VAR\n")
    spec = SandboxSpec(
        "grade", str(tmp_path / "ws"), image=tiny_image, tools=(), script=("bash", "/workspace/grade.sh")
    )
    code, output = create_sandbox("bwrap", spec).run(30)
    assert code == 0 and output.strip() == "hello from the image\nfrom-image"


@pytest.fixture(scope="module")
def repo_image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """An image whose /testbed is at a base commit, with a later fix on another branch, a tag and
    a reflog entry (as published images may have): (image, base, fix)."""
    root = tmp_path_factory.mktemp("repo-image")
    repo = root / "testbed"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
        ).stdout.strip()

    git("init", "-q", "-b", "main")
    git("config", "user.email", "dev@example.com")
    git("config", "user.name", "dev")
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / ".gitignore").write_text("build/\n")
    git("add", "-A")
    git("commit", "-qm", "base")
    base = git("rev-parse", "HEAD")
    git("checkout", "-qb", "upstream")
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b  # THE UPSTREAM FIX\n")
    git("commit", "-qam", "fix add")
    fix = git("rev-parse", "HEAD")
    git("tag", "v-fixed")
    git("checkout", "-q", "main")
    (repo / "build").mkdir()
    (repo / "build" / "artifact.o").write_text("compiled")
    (repo / "left-by-image-build.txt").write_text("untracked")
    return build_tiny_image(root, "repo", testbed=repo), base, fix


def test_a_pinned_repository_holds_nothing_after_its_commit(image_node, repo_image, tmp_path, monkeypatch):
    image, base, fix = repo_image
    monkeypatch.setenv("ROLLOUT_IMAGE_ROOTS", str(Path(image.split(":")[1]).parent))
    get_settings.cache_clear()
    with image_box(image, tmp_path / "ws", workdir="/testbed", pin_repo=("/testbed", base)) as box:
        assert bash(box, "git log --all --format=%H") == base
        assert bash(box, "git reflog | wc -l; git tag; git branch -a") == "0\n* main"
        assert "Not a valid object name" in bash(box, f"git cat-file -p {fix} 2>&1")
        assert "THE UPSTREAM FIX" not in bash(box, "grep -r 'UPSTREAM' /testbed/.git 2>/dev/null; git log -p --all")
        bash(box, "sed -i 's/a - b/a + b/' calc.py")
        assert (
            bash(box, f"git add -A && git diff --cached --stat {base}")
            == " calc.py | 2 +-\n 1 file changed, 1 insertion(+), 1 deletion(-)"
        )


def test_a_pin_at_a_commit_the_image_s_repository_is_not_at_is_a_task_error(
    image_node, repo_image, tmp_path, monkeypatch
):
    image, base, fix = repo_image
    monkeypatch.setenv("ROLLOUT_IMAGE_ROOTS", str(Path(image.split(":")[1]).parent))
    get_settings.cache_clear()
    with pytest.raises(TaskError, match="is not at task.base_commit"):
        image_box(image, tmp_path / "a", pin_repo=("/testbed", fix)).start()
    with pytest.raises(TaskError, match="is not a commit of the repository"):
        image_box(image, tmp_path / "b", pin_repo=("/testbed", "0" * 40)).start()
    with pytest.raises(TaskError, match="has no git repository at /nowhere"):
        image_box(image, tmp_path / "c", pin_repo=("/nowhere", base)).start()


def test_an_image_sandbox_without_the_fork_server_is_refused_with_the_way_out(
    image_node, tiny_image, tmp_path, monkeypatch
):
    monkeypatch.setenv("ROLLOUT_SANDBOX_FORK_SERVER", "0")
    get_settings.cache_clear()
    with pytest.raises(SandboxError, match="ROLLOUT_SANDBOX_FORK_SERVER=1"):
        image_box(tiny_image, tmp_path / "ws").start()


def test_a_shallow_repository_in_an_image_is_pinned_too(image_node, repo_image, tmp_path, monkeypatch):
    image, base, _ = repo_image
    source = Path(image.split(":")[1]).parent / "testbed"
    shallow = tmp_path / "shallow-image"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{source}", str(shallow / "testbed")], check=True)
    shallow_image = build_tiny_image(shallow, "shallow", testbed=shallow / "testbed")
    monkeypatch.setenv("ROLLOUT_IMAGE_ROOTS", f"{Path(image.split(':')[1]).parent},{shallow}")
    get_settings.cache_clear()
    with image_box(shallow_image, tmp_path / "ws", workdir="/testbed", pin_repo=("/testbed", base)) as box:
        assert bash(box, "git log --all --format=%H; git rev-parse --is-shallow-repository") == f"{base}\ntrue"


def test_an_image_whose_setup_committed_on_top_of_the_base_is_pinned_at_that_commit(
    image_node, repo_image, tmp_path, monkeypatch
):
    """SWE-bench's image setup ends with ``git commit --allow-empty -am SWE-bench`` on base_commit."""
    image, base, fix = repo_image
    copy = tmp_path / "official" / "testbed"
    shutil.copytree(Path(image.split(":")[1]).parent / "testbed", copy, symlinks=True)
    (copy / "calc.py").write_text("def add(a, b):\n    return a - b  # touched by the install step\n")
    setup = ["git", "-C", str(copy), "-c", "user.name=SWE-bench", "-c", "user.email=setup@swebench.config"]
    subprocess.run([*setup, "commit", "-q", "--allow-empty", "-am", "SWE-bench"], check=True)
    head = subprocess.run(["git", "-C", str(copy), "rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    official = build_tiny_image(tmp_path / "official", "official", testbed=copy)
    monkeypatch.setenv("ROLLOUT_IMAGE_ROOTS", str(tmp_path / "official"))
    get_settings.cache_clear()
    with image_box(official, tmp_path / "ws", workdir="/testbed", pin_repo=("/testbed", base)) as box:
        assert bash(box, "git log --all --format=%s") == "SWE-bench\nbase"
        assert bash(box, "cat .git/rollout-pinned-head") == head.stdout.strip()
        assert bash(box, f"git cat-file -t {fix} 2>/dev/null || echo unreachable") == "unreachable"
        assert bash(box, "git status --short | wc -l") == "0"
