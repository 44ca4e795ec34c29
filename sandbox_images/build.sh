#!/usr/bin/env bash
# Build a Singularity/Apptainer image with the action server runtime installed under
# /opt/rollout-runtime on top of BASE_IMAGE (default python:3.11-slim).
#
#   sandbox_images/build.sh OUT.sif [BASE_IMAGE]
#   sandbox_images/build.sh swe-astropy.sif docker://swebench/sweb.eval.x86_64.astropy__astropy-12907
#
# Unprivileged builds use --fakeroot (Apptainer >= 1.1). Set ROLLOUT_SANDBOX=singularity and give
# the .sif as the task's image.
set -euo pipefail

if [ $# -lt 1 ]; then
    sed -n '2,9p' "$0"
    exit 2
fi
out=$(realpath -m "$1")
base=${2:-python:3.11-slim}
base=${base#docker://}

binary=$(command -v apptainer || command -v singularity || true)
if [ -z "$binary" ]; then
    echo "neither apptainer nor singularity is on PATH: install Apptainer or load its module" >&2
    exit 1
fi

flags=()
if [ "$(id -u)" != 0 ]; then
    flags+=(--fakeroot)
fi

cd "$(dirname "$0")/.."  # %files paths are relative to the repository root
exec "$binary" build "${flags[@]}" --build-arg "BASE_IMAGE=$base" "$out" sandbox_images/rollout-runtime.def
