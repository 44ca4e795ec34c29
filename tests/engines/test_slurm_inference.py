"""slurm/inference.sbatch on the single-node Slurm: it starts vLLM's CPU build (no GPU in the
job), registers it with the control job's gateway once it answers, a job served by it
completes through a worker job, and cancelling the inference job removes the backend."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from rollout_service.devtools.engines import vllm_command, vllm_env
from rollout_service.devtools.redis_server import free_port
from rollout_service.sdk.client import RolloutClient
from rollout_service.settings import get_settings
from tests.fixtures_slurm import SLURM_DIR, job_processes, start_control

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.own_engine
def test_an_inference_job_starts_vllm_on_the_cpus_registers_it_and_serves_jobs(slurm, smollm2_dir, tmp_path):
    control = start_control(slurm, tmp_path / "shared")
    venv = Path(get_settings().vllm_venv)
    port = free_port()
    command = vllm_command(venv if venv.is_absolute() else REPO / venv, smollm2_dir, "smollm2", port)
    extra = command[command.index(str(port)) + 1 :]
    env = {
        **control.env,
        **vllm_env(1.0),
        "MODEL": str(smollm2_dir),
        "SERVED_MODEL_NAME": "smollm2",
        "VLLM_PYTHON": command[0],
        "VLLM_ARGS": " ".join(extra),
        "ROLLOUT_INFERENCE_PORT": str(port),
    }
    jobs = [
        slurm.sbatch(SLURM_DIR / "inference.sbatch", "-c", "1", "--gpus-per-node=0", **env),
        slurm.sbatch(SLURM_DIR / "workers.sbatch", "-N", "1", "-c", "1", **control.env, ROLLOUT_SANDBOX="bwrap"),
    ]
    inference = jobs[0]
    try:
        with RolloutClient(control.gateway, token=control.token) as client:
            deadline = time.monotonic() + 900
            while not [b for b in client.backends() if b.model == "smollm2"]:
                assert slurm.state(inference) in ("PENDING", "RUNNING") and time.monotonic() < deadline, slurm.output(
                    inference
                )[-3000:]
                time.sleep(2)
            (backend,) = client.backends()
            assert backend.healthy and backend.kind == "vllm" and backend.url.endswith(f":{port}")
            (job_id,) = client.submit(
                {"domain": "math", "problem": f"What is 2 + 2? ({uuid.uuid4().hex[:6]})", "answer": "4"},
                sampling={"max_new_tokens": 16},
                agent={"max_turns": 1},
            ).job_ids
            (view,) = client.wait([job_id], timeout_s=300)
            assert view.status.value == "completed", view.error
            trajectory = client.trajectory(job_id)
            assert trajectory.turns[0].backend_id == backend.id and len(trajectory.response_ids) > 0
            slurm.cancel(inference)
            slurm.wait_state(inference, {"CANCELLED"}, 120)
            deadline = time.monotonic() + 30
            while client.backends():
                assert time.monotonic() < deadline, "the cancelled inference job left its backend registered"
                time.sleep(0.5)
            deadline = time.monotonic() + 60
            while job_processes(inference):
                assert time.monotonic() < deadline, f"the cancelled inference job left {job_processes(inference)}"
                time.sleep(0.5)
    finally:
        for job in [*jobs, control.job_id]:
            slurm.cancel(job, check=False)
        for job in [*jobs, control.job_id]:
            slurm.wait_state(job, {"CANCELLED", "COMPLETED", "FAILED"}, 120)
