"""A single-node Slurm for the session (Debian's slurm-wlm and munge, installed by `make test`):
munged, slurmctld and slurmd started as root with their own key, socket, ports and spool under
the session's tmp dir, the node sized from this machine."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from rollout_service.devtools.redis_server import free_port

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "slurm"
VENV_BIN = REPO / ".venv" / "bin"

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "scontrol")
KILL_WAIT_S = 2  # between a cancelled job's SIGTERM and its SIGKILL: a plain scancel kills mid-episode


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]

    def run(self, *command: str, check: bool = True, **env: str) -> str:
        done = subprocess.run(list(command), env={**self.env, **env}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 or not check, f"{' '.join(command)}: {done.stderr or done.stdout}"
        return done.stdout

    def sbatch(self, script: Path, *args: str, **env: str) -> str:
        """Submit ``script``; its output goes to <root>/job-<id>.out. Returns the job id."""
        out = self.run("sbatch", "--parsable", "--output", str(self.root / "job-%j.out"), *args, str(script), **env)
        return out.strip().split(";")[0]

    def state(self, job_id: str) -> str:
        """The job's state (RUNNING, PENDING, ...); "" once Slurm forgot it (MinJobAge)."""
        done = subprocess.run(["scontrol", "show", "job", job_id, "-o"], env=self.env, capture_output=True, text=True)
        fields = dict(part.split("=", 1) for part in done.stdout.split() if "=" in part)
        return fields.get("JobState", "")

    def wait_state(self, job_id: str, states: set[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        raise AssertionError(
            f"job {job_id} is {self.state(job_id)!r}, not {states} after {timeout_s} s; "
            f"its output:\n{self.output(job_id)[-3000:]}"
        )

    def output(self, job_id: str) -> str:
        path = self.root / f"job-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def cancel(self, job_id: str, *args: str, check: bool = True) -> None:
        self.run("scancel", *args, job_id, check=check)


def slurm_conf(root: Path, munge_socket: Path) -> str:
    host = socket.gethostname().split(".")[0]
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    cpus = os.cpu_count() or 1
    return f"""ClusterName=rollout-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
KillWait={KILL_WAIT_S}
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def start_slurm(root: Path) -> SlurmCluster:
    missing = [b for b in SLURM_BINARIES if not shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin")]
    assert not missing, f"{missing} missing: apt-get install slurm-wlm munge (make test installs them)"
    munge = root / "munge"
    munge.mkdir(mode=0o755)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    subprocess.run(
        [
            "munged",
            "--force",
            f"--socket={munge / 'socket'}",
            f"--key-file={key}",
            f"--pid-file={root / 'munged.pid'}",
            f"--log-file={root / 'munged.log'}",
            f"--seed-file={root / 'munged.seed'}",
        ],
        check=True,
        timeout=30,
    )
    for name in ("state", "spool"):
        (root / name).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, munge / "socket"))
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": os.environ.get("PATH", "") + ":/usr/sbin"}
    cluster = SlurmCluster(root, env)
    cluster.run("slurmctld", "-i")
    cluster.run("slurmd")
    deadline = time.monotonic() + 60
    while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, f"the node never became idle: {(root / 'slurmd.log').read_text()[-2000:]}"
        time.sleep(0.5)
    return cluster


def stop_slurm(cluster: SlurmCluster) -> None:
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=cluster.env, capture_output=True, text=True).stdout.split()
    if jobs:
        subprocess.run(["scancel", *jobs], env=cluster.env, timeout=30)
        deadline = time.monotonic() + 30
        while subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, text=True).stdout.strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
    subprocess.run(["scontrol", "shutdown"], env=cluster.env, timeout=30)
    for name in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
        _wait_gone(cluster.root / name, kill=name == "munged.pid")


def _wait_gone(pid_file: Path, kill: bool) -> None:
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().strip() or 0)
    if pid and kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)
    deadline = time.monotonic() + 15
    while pid and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


@dataclass
class ControlJob:
    """slurm/control.sbatch running: what the other jobs find in its shared dir."""

    job_id: str
    shared_dir: Path
    env: dict[str, str]  # what every job of this deployment is submitted with
    gateway: str
    token: str

    @property
    def redis_url(self) -> str:
        return (self.shared_dir / "redis.url").read_text().strip()

    @property
    def broker_url(self) -> str:
        return (self.shared_dir / "broker.url").read_text().strip()


def start_control(cluster: SlurmCluster, shared_dir: Path, **env: str) -> ControlJob:
    """Submit control.sbatch with one CPU, its Redis on loopback with a second Redis as the
    broker, and wait until its gateway is ready."""
    token = secrets.token_urlsafe(16)
    port = free_port()
    job_env = {
        "PATH": f"{VENV_BIN}:{cluster.env['PATH']}",
        "ROLLOUT_SHARED_DIR": str(shared_dir),
        "ROLLOUT_API_TOKEN": token,
        "ROLLOUT_PORT": str(port),
        "ROLLOUT_FLOWER_PORT": str(free_port()),
        "ROLLOUT_REDIS_PORT": str(free_port()),
        "ROLLOUT_BROKER_REDIS_PORT": str(free_port()),
        "ROLLOUT_REDIS_BIND": "127.0.0.1",
        "ROLLOUT_REDIS_HOST": "127.0.0.1",
        "ROLLOUT_BIND_HOST": "127.0.0.1",
        "ROLLOUT_GATEWAY_WORKERS": "1",
        "ROLLOUT_TASK_EVENTS": "false",
        "ROLLOUT_LLM_CONNECT_RETRIES": "1",
        **env,
    }
    job_id = cluster.sbatch(SLURM_DIR / "control.sbatch", "-c", "1", **job_env)
    control = ControlJob(job_id, shared_dir, job_env, f"http://127.0.0.1:{port}", token)
    deadline = time.monotonic() + 90
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{control.gateway}/healthz", timeout=2).status_code == 200:
                return control
        assert cluster.state(job_id) in ("PENDING", "RUNNING") and time.monotonic() < deadline, (
            f"control job {job_id} is {cluster.state(job_id)}: {cluster.output(job_id)[-3000:]}"
        )
        time.sleep(0.5)


def job_processes(job_id: str) -> dict[int, tuple[list[str], dict[str, str]]]:
    """pid -> (command line, environment) of every process of a Slurm job on this node."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            environ = dict(
                item.split("=", 1) for item in (proc / "environ").read_text(errors="replace").split("\0") if "=" in item
            )
            if environ.get("SLURM_JOB_ID") == job_id:
                found[int(proc.name)] = ((proc / "cmdline").read_text().split("\0")[:-1], environ)
    return found


def state_redis(control: ControlJob) -> redis.Redis:
    return redis.Redis.from_url(control.redis_url)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their users only when started as root")
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        stop_slurm(cluster)
