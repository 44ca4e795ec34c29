"""Sandboxes with real bubblewrap and a real Redis: isolation, limits, lifecycle, registry."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from rollout_service.errors import SandboxError, UnknownName
from rollout_service.sandbox import SANDBOXES, SandboxSpec, create_sandbox, reap_expired
from rollout_service.sandbox.base import ServerSandbox
from rollout_service.sandbox.processes import _descendants_by_scan, descendants, kill_tree, process_start_ticks
from rollout_service.sandbox.registry import EXPIRY_KEY, registered, sandbox_key
from rollout_service.sandbox.singularity import ensure_image, singularity_argv
from rollout_service.settings import get_settings
from tests.helpers import command_of, parent_of

STAND_IN = Path(__file__).resolve().parents[1] / "stand_in_singularity"


def bash(sandbox: ServerSandbox, command: str, timeout_s: float = 10) -> dict:
    return sandbox.execute("bash", {"command": command}, timeout_s)


def alive(pids: list[int]) -> list[int]:
    """Pids that still exist and are not zombies."""
    living = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            living.append(pid)
    return living


def wait_until(condition: Callable[[], object], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture(autouse=True, params=["forked by the fork server", "a bwrap each"])
def bwrap_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test runs both ways a bwrap sandbox starts as root (without root, always a bwrap each)."""
    monkeypatch.setenv("ROLLOUT_SANDBOX_FORK_SERVER", "1" if request.param.startswith("forked") else "0")
    get_settings.cache_clear()
    yield request.param
    get_settings.cache_clear()


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    (path / "README.md").write_text("hello\n")
    return path


@pytest.fixture
def sandbox(workspace: Path, bwrap_mode: str) -> Iterator[ServerSandbox]:
    box = create_sandbox("bwrap", SandboxSpec("job-test", str(workspace), tools=("bash", "editor", "finish")))
    box.start()
    assert (type(box.process).__name__ == "Forked") == (bwrap_mode.startswith("forked") and os.geteuid() == 0)
    yield box
    box.stop()


def test_unknown_sandbox_kind_is_an_error_listing_the_valid_kinds(workspace: Path) -> None:
    with pytest.raises(UnknownName) as info:
        create_sandbox("docker", SandboxSpec("j", str(workspace)))
    for kind in SANDBOXES:
        assert kind in str(info.value)


def test_start_without_a_workspace_says_what_to_do(tmp_path: Path) -> None:
    box = create_sandbox("bwrap", SandboxSpec("j", str(tmp_path / "missing")))
    with pytest.raises(SandboxError, match="init stage must create it"):
        box.start()
    box.stop()


def test_sandbox_can_write_its_workspace_and_nothing_else(
    sandbox: ServerSandbox, workspace: Path, tmp_path: Path
) -> None:
    assert bash(sandbox, "echo made > /workspace/new.txt && cat README.md")["output"] == "hello"
    assert (workspace / "new.txt").read_text() == "made\n"
    for target in ("/etc/escape", f"{tmp_path}/escape", "/work/escape", "/escape", "/usr/escape"):
        observation = bash(sandbox, f"touch {target}")
        assert observation["exit_code"] != 0, target
    scratch = f"/tmp/sandbox-private-{uuid.uuid4().hex}"
    assert bash(sandbox, f"echo private > {scratch} && cat {scratch}")["output"] == "private"
    assert not Path(scratch).exists()
    assert not (tmp_path / "escape").exists()
    assert Path(sandbox.socket_dir).parent == Path(get_settings().scratch_path)  # /dev/shm here: a tmpfs
    assert bash(sandbox, "ls -A /dev/shm")["output"] == ""  # its own, not the one with every socket directory


def test_sandbox_cannot_read_the_services_state(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outside_tmp = Path(tempfile.mkdtemp(dir="/var/tmp"))  # the sandbox has its own /tmp anyway
    state = outside_tmp / "state"
    state.mkdir()
    (state / "jobs.aof").write_text("ground truth answers")
    for path in (outside_tmp, state):
        path.chmod(0o755)
    monkeypatch.setenv("ROLLOUT_STATE_DIR", str(state))
    get_settings.cache_clear()
    try:
        with create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash",))) as box:
            assert bash(box, f"ls {outside_tmp}")["output"] == "state"  # visible, so the test could fail
            assert bash(box, f"ls -A {state}")["output"] == ""
    finally:
        get_settings.cache_clear()
        shutil.rmtree(outside_tmp)


def test_sandbox_cannot_open_a_network_connection(sandbox: ServerSandbox, redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
    for host in ("127.0.0.1", "1.1.1.1"):
        code = f"import socket; socket.create_connection(('{host}', {port}), timeout=2)"
        observation = bash(sandbox, f'python3 -c "{code}"')
        assert observation["exit_code"] == 1, observation
        assert "Error" in observation["output"]


def test_sandbox_cannot_see_the_workers_environment(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_SECRET_TOKEN", "do-not-leak")
    spec = SandboxSpec("j", str(workspace), tools=("bash",), env={"TASK_FLAG": "visible"})
    with create_sandbox("bwrap", spec) as box:
        env = bash(box, "env")["output"]
    assert "do-not-leak" not in env and "WORKER_SECRET_TOKEN" not in env
    assert "TASK_FLAG=visible" in env
    assert "PYTHONPATH" not in env


def test_fork_bomb_is_contained_and_the_host_stays_responsive(workspace: Path) -> None:
    spec = SandboxSpec("j", str(workspace), tools=("bash",), max_procs=48)
    box = create_sandbox("bwrap", spec)
    box.start()
    try:
        assert bash(box, "bomb() { bomb | bomb & }; bomb", timeout_s=5)["timed_out"] is False
        time.sleep(1.5)
        counts = []
        for _ in range(5):
            counts.append(len(descendants(box.process.pid)))
            time.sleep(0.1)
        started = time.monotonic()
        subprocess.run(["true"], check=True)
        assert time.monotonic() - started < 1.0
        assert max(counts) <= spec.max_procs + 3, counts
        assert max(counts) >= spec.max_procs // 2, "the bomb did not run, so nothing was proven"
        # the bomb's own "fork: retry" complaints may land on either side of the answer
        assert "still answering" in bash(box, "echo still answering", timeout_s=10)["output"].splitlines()
        pids = descendants(box.process.pid)
    finally:
        box.stop()
    assert wait_until(lambda: not alive(pids)), alive(pids)


def test_memory_hog_gets_a_memory_error_and_the_sandbox_survives(workspace: Path) -> None:
    spec = SandboxSpec("j", str(workspace), tools=("bash",), memory_mb=256)
    with create_sandbox("bwrap", spec) as box:
        observation = bash(box, "python3 -c 'x = bytearray(4 * 1024**3)'")
        assert observation["exit_code"] == 1
        assert "MemoryError" in observation["output"]
        assert bash(box, "echo fine")["output"] == "fine"


def test_stop_kills_every_process_of_the_sandbox_even_detached_ones(workspace: Path) -> None:
    box = create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash", "ipython")))
    box.start()
    bash(box, "sleep 1000 & setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 &")
    assert box.execute("ipython", {"code": "1 + 1"}, 60)["output"] == "2"
    pids = descendants(box.process.pid)
    assert len(pids) >= 5  # bwrap init, server, bash, three sleeps, kernel
    box.stop()
    box.stop()  # idempotent
    assert box.process.poll() is not None
    assert wait_until(lambda: not alive(pids)), alive(pids)
    assert not os.path.exists(box.socket_dir)


def test_execute_after_the_server_died_raises_sandbox_error(sandbox: ServerSandbox) -> None:
    assert bash(sandbox, "true")["exit_code"] == 0  # the shell is up: no forked child still looks like the server
    shells = [pid for pid in descendants(sandbox.process.pid) if command_of(pid).split(" ")[0].endswith("bash")]
    server = [parent_of(pid) for pid in shells]
    assert len(server) == 1 and command_of(server[0]).startswith(sys.executable)
    os.kill(server[0], 9)
    assert wait_until(lambda: not alive(server))
    with pytest.raises(SandboxError, match="stopped answering"):
        bash(sandbox, "echo hi")


def test_boot_to_first_answer_is_fast(workspace: Path) -> None:
    boots = []
    for _ in range(5):
        with create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash", "editor", "finish"))) as box:
            boots.append(box.boot_s)
    assert statistics.median(boots) < 0.5, boots  # bench/tools.py measures the real p50 (about 60 ms)


def test_started_sandbox_is_registered_and_stop_unregisters_it(workspace: Path, redis_client: redis.Redis) -> None:
    box = create_sandbox("bwrap", SandboxSpec("job-7", str(workspace), tools=("bash",), ttl_s=60), redis_client)
    box.start()
    record = registered(redis_client, box.sandbox_id)
    assert record["job_id"] == "job-7"
    assert record["host"] == socket.gethostname()
    assert int(record["pid"]) == box.process.pid
    assert float(record["expiry"]) == pytest.approx(time.time() + 60, abs=5)
    assert redis_client.zscore(EXPIRY_KEY, box.sandbox_id) is not None
    box.stop()
    assert not redis_client.exists(sandbox_key(box.sandbox_id))
    assert redis_client.zscore(EXPIRY_KEY, box.sandbox_id) is None


def test_reaper_kills_an_expired_sandbox_and_leaves_live_ones(
    workspace: Path, tmp_path: Path, redis_client: redis.Redis
) -> None:
    live_ws = tmp_path / "live"
    live_ws.mkdir()
    expired = create_sandbox("bwrap", SandboxSpec("old", str(workspace), tools=("bash",), ttl_s=0.2), redis_client)
    live = create_sandbox("bwrap", SandboxSpec("new", str(live_ws), tools=("bash",), ttl_s=600), redis_client)
    expired.start()
    live.start()
    try:
        pids = descendants(expired.process.pid)
        time.sleep(0.3)
        assert reap_expired(redis_client, socket.gethostname()) == [expired.sandbox_id]
        assert wait_until(lambda: not alive(pids)), alive(pids)
        with pytest.raises(SandboxError):
            bash(expired, "echo hi")
        assert not redis_client.exists(sandbox_key(expired.sandbox_id))
        assert bash(live, "echo alive")["output"] == "alive"
        assert reap_expired(redis_client, socket.gethostname()) == []
    finally:
        expired.stop()
        live.stop()


def test_reaper_of_one_host_leaves_other_hosts_alone_and_never_kills_their_pids(redis_client: redis.Redis) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        started = process_start_ticks(sleeper.pid)
        record = {"host": "another-node", "pid": sleeper.pid, "pid_start": started, "expiry": 0}
        redis_client.hset(sandbox_key("abc"), mapping=record)
        redis_client.zadd(EXPIRY_KEY, {"abc": 0})
        assert reap_expired(redis_client, socket.gethostname()) == []
        assert redis_client.exists(sandbox_key("abc"))
        assert reap_expired(redis_client) == ["abc"]  # every host: the record goes, the local pid lives
        assert sleeper.poll() is None
        assert redis_client.zcard(EXPIRY_KEY) == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_local_sandbox_warns_on_every_start_and_runs_in_the_workspace(
    workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        with create_sandbox("local", SandboxSpec("j", str(workspace), tools=("bash",))) as box:
            assert bash(box, "pwd")["output"] == str(workspace)
    assert sum("NO ISOLATION" in r.getMessage() for r in caplog.records) == 2


@pytest.fixture
def stand_in_singularity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "singularity").symlink_to(STAND_IN)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_PYTHON", sys.executable)
    log = tmp_path / "singularity-calls.jsonl"
    monkeypatch.setenv("STAND_IN_SINGULARITY_LOG", str(log))
    return log


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line)[1:] for line in log.read_text().splitlines()] if log.exists() else []


def test_singularity_command_contains_the_isolation_flags_binds_and_runtime(
    workspace: Path, tmp_path: Path, stand_in_singularity: Path
) -> None:
    spec = SandboxSpec("j", str(workspace), env={"A": "1"})
    argv = singularity_argv(spec, "/images/x.sif", str(tmp_path))
    assert argv[0].endswith("singularity") and argv[1] == "exec"
    for flag in ("--containall", "--cleanenv", "--writable-tmpfs", "--no-home", "--net"):
        assert flag in argv
    assert argv[argv.index("--network") + 1] == "none"
    assert f"{workspace}:/workspace" in argv and f"{tmp_path}:/run/rollout" in argv
    assert argv[argv.index("--env") + 1] == "A=1"
    image_at = argv.index("/images/x.sif")
    assert argv[image_at + 1] == "/opt/rollout-runtime/bin/python"
    assert "--socket" in argv[image_at:] and "/run/rollout/action.sock" in argv[image_at:]


def test_singularity_sandbox_runs_the_action_server_through_the_binary(
    workspace: Path, tmp_path: Path, stand_in_singularity: Path
) -> None:
    image = tmp_path / "runtime.sif"
    image.write_text("stand-in")
    spec = SandboxSpec("j", str(workspace), image=str(image), tools=("bash", "finish"), env={"TASK": "t1"})
    box = create_sandbox("singularity", spec)
    box.start()
    try:
        assert bash(box, "pwd; echo $TASK")["output"] == "/workspace\nt1"
        assert box.execute("finish", {"answer": "42"}, 5)["answer"] == "42"
        pids = descendants(box.process.pid)
    finally:
        box.stop()
    assert wait_until(lambda: not alive(pids))
    (exec_call,) = [c for c in calls(stand_in_singularity) if "exec" in c]
    assert {"--containall", "--cleanenv", "--writable-tmpfs", "--no-home"} <= set(exec_call)
    assert exec_call[exec_call.index("--network") + 1] == "none"
    assert str(image) in exec_call


def test_docker_image_is_converted_once_even_when_asked_concurrently(
    tmp_path: Path, stand_in_singularity: Path
) -> None:
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_image("docker://python:3.11-slim", tmp_path / "cache")))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and results[0].endswith(".sif") and os.path.exists(results[0])
    builds = [c for c in calls(stand_in_singularity) if "build" in c]
    assert len(builds) == 1 and builds[0][-1] == "docker://python:3.11-slim"
    assert ensure_image("docker://python:3.11-slim", tmp_path / "cache") == results[0]


def test_singularity_without_an_image_is_a_clear_error(workspace: Path) -> None:
    with pytest.raises(SandboxError, match="needs an image"):
        ensure_image(None)


def test_a_sandbox_started_from_a_short_lived_thread_outlives_it(workspace: Path) -> None:
    box = create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash",)))
    starter = threading.Thread(target=box.start)
    starter.start()
    starter.join()
    try:
        time.sleep(0.2)
        assert bash(box, "echo alive")["output"] == "alive"
    finally:
        box.stop()


def test_the_action_server_starts_with_only_what_it_needs_imported():
    """It starts in every sandbox, so every import is paid at every boot: Redis, pydantic and the
    sandbox package took a boot from 60 ms to 170 ms; site, argparse and subprocess cost ~25 ms more."""
    import subprocess
    import sys

    from rollout_service.sandbox.base import host_import_paths

    heavy = (
        "redis",
        "pydantic",
        "rollout_service.state.store",
        "rollout_service.sandbox",
        "argparse",
        "subprocess",
        "site",
        "typing",
    )
    probe = (
        f"import sys; sys.path[:0] = {host_import_paths()!r}; import rollout_service.tools.action_server, "
        f"rollout_service.tools.bash; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    assert (
        subprocess.run(
            [sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "[]"
    )


def test_descendants_walks_only_the_subtree_and_finds_what_a_full_proc_scan_finds():
    tree = subprocess.Popen(["bash", "-c", "sleep 30 & (sleep 30 & (sleep 30 & wait) & wait) & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(_descendants_by_scan(tree.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (
            sorted(descendants(tree.pid)) == sorted(_descendants_by_scan(tree.pid)) and len(descendants(tree.pid)) == 5
        )
    finally:
        kill_tree(tree.pid)
        tree.wait()
    assert descendants(tree.pid) == []


def test_a_green_worker_spawns_sandboxes_without_forking_itself_and_stops_them_whole(tmp_path: Path) -> None:
    """A gevent worker starts bwrap with posix_spawn (vfork) instead of gevent's fork of the whole
    worker; the sandbox still answers, a dead one is noticed, and stop leaves no process behind. The
    worker holds more than 1,024 descriptors (as one with hundreds of sandboxes does), which select()
    refuses."""
    program = textwrap.dedent(f"""
        from gevent import monkey; monkey.patch_all()
        import json, os, resource, time
        import gevent
        from rollout_service.sandbox import SandboxSpec, create_sandbox
        from rollout_service.sandbox.processes import descendants

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]

        def boot(n):
            workspace = os.path.join({str(tmp_path)!r}, f"w{{n}}")
            os.makedirs(workspace)
            sandbox = create_sandbox("bwrap", SandboxSpec(job_id=f"green-{{n}}", workspace=workspace,
                                                          tools=("bash",)))
            sandbox.start()
            return sandbox

        sandboxes = [g.value for g in gevent.joinall([gevent.spawn(boot, n) for n in range(4)], raise_error=True)]
        outputs = [s.execute("bash", {{"command": "echo $((6 * 7))"}}, 10)["output"].strip() for s in sandboxes]
        pids = [p for s in sandboxes for p in [s.process.pid, *descendants(s.process.pid)]]
        kinds = sorted({{type(s.process).__name__ for s in sandboxes}})
        from rollout_service.sandbox.bwrap import _fork_server
        if _fork_server._process is not None:
            kinds.append("server: " + type(_fork_server._process).__name__)
        for s in sandboxes:
            s.stop()
        time.sleep(0.2)
        os.makedirs(os.path.join({str(tmp_path)!r}, "once"))
        once = create_sandbox("bwrap", SandboxSpec(job_id="green-once", workspace=os.path.join({str(tmp_path)!r}, "once"),
                                                   tools=(), script=("/bin/echo", "graded")))
        print(json.dumps({{"outputs": outputs, "kinds": kinds, "pids": pids, "once": once.run(30),
                          "returncodes": [s.process.poll() is not None for s in sandboxes]}}))
    """)
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outputs"] == ["42"] * 4 and result["kinds"] in (["Spawned"], ["Forked", "server: Spawned"])
    assert len(result["pids"]) > 4 and not alive(result["pids"]) and all(result["returncodes"])
    assert result["once"] == [0, "graded\n"]


def test_a_one_shot_sandbox_runs_its_script_confined_and_returns_its_output(workspace: Path) -> None:
    (workspace / "probe.py").write_text(
        "import os, resource, sys\n"
        "print('args', sys.argv[1:], 'cwd', os.getcwd())\n"
        "print('nproc', resource.getrlimit(resource.RLIMIT_NPROC)[0], 'uid0', os.getuid() == 0)\n"
        "print('network', open('/proc/net/dev').read().count(':'))\n"
        "sys.stderr.write('to stderr\\n'); sys.exit(3)\n"
    )
    spec = SandboxSpec("one-shot", str(workspace), max_procs=77, script=("/workspace/probe.py", "a b", "c"))
    exit_code, output = create_sandbox("bwrap", spec).run(timeout_s=30)
    assert exit_code == 3
    assert "args ['a b', 'c'] cwd /workspace" in output and "nproc 77 uid0 False" in output
    assert "network 1" in output and "to stderr" in output  # only loopback; stderr is kept too
    with pytest.raises(SandboxError, match="needs a SandboxSpec with a script"):
        create_sandbox("bwrap", SandboxSpec("no-script", str(workspace))).run(timeout_s=5)
    program = SandboxSpec("program", str(workspace), script=("bash", "-c", "echo $((6 * 7)) from $PWD; exit 4"))
    assert create_sandbox("bwrap", program).run(timeout_s=30) == (4, "42 from /workspace\n")  # not Python: exec'd


def test_a_one_shot_script_past_its_time_is_killed_with_everything_it_started(workspace: Path) -> None:
    (workspace / "hang.py").write_text(
        "import os, subprocess, time\n"
        "subprocess.Popen(['sleep', '301.25'], start_new_session=True)\n"
        "print('started', flush=True)\n"
        "time.sleep(300)\n"
    )
    box = create_sandbox("bwrap", SandboxSpec("hang", str(workspace), script=("/workspace/hang.py",)))
    began = time.monotonic()
    exit_code, output = box.run(timeout_s=1.0)
    assert (
        exit_code is None and time.monotonic() - began < 10 and output.startswith("started")
    )  # what it printed is kept
    time.sleep(0.2)
    assert not [pid for pid in alive([box.process.pid]) if "sleep" in command_of(pid) or "bwrap" in command_of(pid)]
    assert not any("sleep 301.25" in command_of(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit())


def test_forked_sandboxes_share_nothing_and_die_with_their_fork_server(tmp_path: Path, bwrap_mode: str) -> None:
    if not bwrap_mode.startswith("forked") or os.geteuid() != 0:
        pytest.skip("the fork server serves root workers")
    from rollout_service.sandbox.bwrap import HOST_VIEW, _fork_server

    boxes = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        boxes.append(create_sandbox("bwrap", SandboxSpec(name, str(tmp_path / name), tools=("bash",))))
        boxes[-1].start()
    a, b = boxes
    try:
        bash(a, "echo secret > /tmp/note; echo mine > /workspace/a.txt; sleep 1000 &")
        assert bash(b, "cat /tmp/note 2>&1")["output"].startswith("cat: /tmp/note: No such file or directory")
        assert bash(b, "ls -A /workspace " + HOST_VIEW)["output"] == f"{HOST_VIEW}:\n\n/workspace:"
        assert "sleep" not in bash(b, "ps -e -o comm")["output"]  # its own pid namespace
        assert bash(b, "grep CapEff /proc/self/status")["output"].split() == ["CapEff:", "0000000000000000"]
        assert bash(b, "id -u")["output"] != bash(a, "id -u")["output"]  # a uid each
        pids = [a.process.pid, *descendants(a.process.pid)]
        os.kill(_fork_server._process.pid, 9)  # the fork server dies: its sandboxes go with it
        assert wait_until(lambda: not alive(pids)), alive(pids)
        with pytest.raises(SandboxError):
            bash(a, "echo hi")
        (tmp_path / "c").mkdir()
        with create_sandbox("bwrap", SandboxSpec("c", str(tmp_path / "c"), tools=("bash",))) as c:
            assert bash(c, "echo started again")["output"] == "started again"
    finally:
        for box in boxes:
            box.stop()


def test_a_forked_sandboxs_tool_server_is_its_pid_1_and_reaps_the_orphans_it_inherits(
    workspace: Path, bwrap_mode: str
) -> None:
    if not bwrap_mode.startswith("forked") or os.geteuid() != 0:
        pytest.skip("the fork server serves root workers")
    with create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash",))) as box:
        uid_of_pid_1 = bash(box, "awk '/^Uid/ {print $2}' /proc/1/status")["output"]
        assert uid_of_pid_1 == bash(box, "id -u")["output"] != "0"  # the tool server, under the sandbox's uid
        bash(box, "for i in 1 2 3; do (sleep 0.05 &); done")  # each sleep's parent exits: pid 1 inherits it
        time.sleep(0.3)
        zombies = lambda: bash(box, "ps -e -o stat= | grep -c '^Z' || true")["output"]  # noqa: E731
        assert zombies() == "0"  # reaped when the next call came in
        assert bash(box, "kill -9 1; echo still here")["output"] == "still here"  # pid 1 ignores its sandbox's signals
        assert bash(box, "echo alive")["output"] == "alive"


def test_a_forked_sandbox_boots_at_its_fork_servers_lowered_priority_and_serves_at_its_own(
    workspace: Path, bwrap_mode: str
) -> None:
    """A wave of boots yields to the worker starting episodes; the tools the agent waits for do not."""
    if not bwrap_mode.startswith("forked") or os.geteuid() != 0:
        pytest.skip("the fork server serves root workers")
    from rollout_service.concurrency.priority import rank

    def stat(pid: int) -> list[str]:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()

    with create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash",))) as box:
        server = int(stat(box.process.pid)[1])
        assert rank(server) == get_settings().sandbox_boot_niceness > 0
        assert rank(box.process.pid) == 0 and stat(box.process.pid)[3] != stat(server)[3]  # a session of its own
        assert bash(box, "nice")["output"] == "0"


def test_a_forked_sandbox_whose_worker_stopped_reading_its_status_ends_quietly(
    workspace: Path, bwrap_mode: str
) -> None:
    if not bwrap_mode.startswith("forked") or os.geteuid() != 0:
        pytest.skip("the fork server serves root workers")
    box = create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash",)))
    box.start()
    try:
        init = box.process.pid
        os.close(box.process._status)  # nobody reads the exit code any more
        box._client.close()  # the server's connection ends: it exits and writes its code
        assert wait_until(lambda: not alive([init])), alive([init])
        log = Path(box.socket_dir, "server.log").read_text()
        assert "Traceback" not in log, log  # it ended at its own exit, not through the fork server's loop
        with create_sandbox("bwrap", SandboxSpec("k", str(workspace), tools=("bash",))) as other:
            assert bash(other, "echo next")["output"] == "next"
    finally:
        box.process._status = os.open(os.devnull, os.O_RDONLY)
        box._client = None
        box.stop()


def test_a_sandbox_started_in_the_background_is_waited_for_by_the_first_tool_call(
    workspace: Path, tmp_path: Path
) -> None:
    from rollout_service.sandbox.base import BackgroundStart

    starting = BackgroundStart(create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash",))))
    try:
        assert starting.execute("bash", {"command": "echo ready"}, 10)["output"] == "ready"
        assert 0 < starting.waited_s < starting.sandbox.boot_s + 0.05  # the call waited for the boot, no longer
        pids = [starting.sandbox.process.pid, *descendants(starting.sandbox.process.pid)]
    finally:
        began = time.monotonic()
        starting.stop_soon()
        assert time.monotonic() - began < 0.05  # the caller goes on
    assert wait_until(lambda: starting.sandbox.process.poll() is not None and not alive(pids)), alive(pids)
    broken = BackgroundStart(create_sandbox("bwrap", SandboxSpec("j", str(tmp_path / "missing"), tools=("bash",))))
    with pytest.raises(SandboxError, match="init stage must create it"):  # raised where the sandbox is used
        broken.execute("bash", {"command": "true"}, 10)
    broken.stop()


def test_sandboxes_stopped_in_the_background_are_torn_down_a_few_at_a_time_and_all_of_them(
    workspace: Path, bwrap_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's end stops hundreds at once: they take turns, so the episodes still running keep the CPU."""
    from rollout_service.sandbox import base

    monkeypatch.setenv("ROLLOUT_SANDBOX_CONCURRENT_STOPS", "2")
    get_settings.cache_clear()
    monkeypatch.setattr(base, "_turns", {})
    inside, most = [0], [0]
    real_stop = base.ServerSandbox.stop

    def counted_stop(self: base.ServerSandbox) -> None:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.1)  # long enough for the others to queue up
            real_stop(self)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(base.ServerSandbox, "stop", counted_stop)
    for i in range(5):
        (workspace / f"w{i}").mkdir()  # one each: a sandbox owns its workspace
    boxes = [
        base.BackgroundStart(create_sandbox("bwrap", SandboxSpec(f"j{i}", str(workspace / f"w{i}"), tools=("bash",))))
        for i in range(5)
    ]
    pids = []
    for box in boxes:
        assert box.execute("bash", {"command": "echo up"}, 30)["output"] == "up"
        pids += [box.sandbox.process.pid, *descendants(box.sandbox.process.pid)]
    for box in boxes:
        box.stop_soon()
    assert wait_until(lambda: not alive(pids), timeout_s=20), alive(pids)
    assert most[0] == 2


def test_a_one_shot_module_runs_its_main_confined_and_the_code_grader_grades_that_way(workspace: Path) -> None:
    grading = {
        "program": "def f():\n    return 1\n",
        "tests": ["assert f() == 1", "assert f() == 2"],
        "timeout_s": 5,
        "budget_s": 20,
        "nonce": "n0nce",
        "site_paths": [],
    }
    (workspace / "grading.json").write_text(json.dumps(grading))
    spec = SandboxSpec(
        "grade", str(workspace), script=("module:rollout_service.tools.code_runner", "/workspace/grading.json")
    )
    exit_code, output = create_sandbox("bwrap", spec).run(timeout_s=30)
    assert exit_code == 0, output
    results = json.loads(output.strip().splitlines()[-1].split(" ", 1)[1])
    assert [r["status"] for r in results] == ["passed", "failed"] and "AssertionError" in results[1]["error"]
    assert not (workspace / "grading.json").exists()  # read, then deleted before any submitted code ran


LEAVING_WORKER = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import redis
    from rollout_service.sandbox import SandboxSpec, create_sandbox
    from rollout_service.sandbox.base import BackgroundStart
    from rollout_service.sandbox.processes import descendants
    from rollout_service.tasks.sandboxed import grading_workspace

    client, root, ending = redis.Redis.from_url(sys.argv[1]), sys.argv[2], sys.argv[3]

    def spec(name, **options):
        os.makedirs(os.path.join(root, name))
        return SandboxSpec(name, os.path.join(root, name), **{"tools": ("bash",), "ttl_s": 3600, **options})

    serving = [create_sandbox(kind, spec(f"serving-{n}"), client) for n, kind in enumerate(["bwrap", "local"])]
    for box in serving:
        box.start()
    stopping = [BackgroundStart(create_sandbox("bwrap", spec(f"stopping-{n}"), client)) for n in range(3)]
    for box in stopping:
        box.ready()
    grading = grading_workspace("code", small=True)
    grading.__enter__()
    grader = create_sandbox("bwrap", spec("grading", tools=(), script=("sleep", "300")))
    threading.Thread(target=grader.run, args=(300,), daemon=True).start()
    while grader.process is None:
        time.sleep(0.01)
    boxes = serving + [box.sandbox for box in stopping] + [grader]
    time.sleep(0.3)
    pids = [pid for box in boxes for pid in [box.process.pid, *descendants(box.process.pid)]]
    for box in stopping:
        box.stop_soon()
    print(json.dumps(pids), flush=True)
    if ending == "exits while stopping sandboxes in the background":
        sys.exit(0)
    time.sleep(600)
""")


def scratch_entries(scratch: Path) -> list[str]:
    return sorted(p.name for p in scratch.iterdir())


def sandboxes_alive_gauge(redis_client: redis.Redis) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    from rollout_service.gateway.metrics import render

    return next(
        s.value
        for family in text_string_to_metric_families(render(redis_client))
        for s in family.samples
        if s.name == "rollout_sandboxes_alive"
    )


@pytest.fixture
def private_scratch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A scratch directory of this test's own (short: socket paths must fit in 107 bytes)."""
    scratch = Path(tempfile.mkdtemp(prefix="rs-"))
    monkeypatch.setenv("ROLLOUT_SANDBOX_SCRATCH_DIR", str(scratch))
    get_settings.cache_clear()
    yield scratch
    get_settings.cache_clear()
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.parametrize("ending", ["SIGKILL", "SIGTERM", "exits while stopping sandboxes in the background"])
def test_a_worker_that_dies_leaves_no_scratch_directory_process_or_registration_once_reaped(
    tmp_path: Path,
    private_scratch: Path,
    redis_client: redis.Redis,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    ending: str,
) -> None:
    monkeypatch.setenv("ROLLOUT_SANDBOX_CONCURRENT_STOPS", "1")
    (tmp_path / "ours").mkdir()
    ours = create_sandbox(
        "bwrap", SandboxSpec("ours", str(tmp_path / "ours"), tools=("bash",), ttl_s=600), redis_client
    )
    ours.start()
    try:
        worker = subprocess.Popen(
            [sys.executable, "-c", LEAVING_WORKER, redis_url, str(tmp_path / "w"), ending],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        pids = json.loads(worker.stdout.readline() or "[]")
        assert len(pids) >= 6 and sandboxes_alive_gauge(redis_client) >= 3  # ours and its two serving
        if ending.startswith("SIG"):
            worker.send_signal(getattr(signal, ending))
        assert worker.wait(timeout=60) == (0 if ending.startswith("exits") else -getattr(signal, ending))
        if ending.startswith("exits"):  # it stopped them on its way out: nothing for a reaper to do
            assert scratch_entries(private_scratch) == [Path(ours.socket_dir).name]
            assert sandboxes_alive_gauge(redis_client) == 1

        assert reap_expired(redis_client, socket.gethostname()) is not None
        assert wait_until(lambda: not alive(pids), timeout_s=10), [command_of(p) for p in alive(pids)]
        assert scratch_entries(private_scratch) == [Path(ours.socket_dir).name]
        assert sandboxes_alive_gauge(redis_client) == 1 and redis_client.zrange(EXPIRY_KEY, 0, -1) == [
            ours.sandbox_id.encode()
        ]
        assert bash(ours, "echo still serving")["output"] == "still serving"
    finally:
        ours.stop()
    assert scratch_entries(private_scratch) == [] and sandboxes_alive_gauge(redis_client) == 0
