# One image for every role of docker-compose.yml (gateway, workers, flower).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap git tmux skopeo umoci patch \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY setup.cfg pyproject.toml README.md ./
COPY rollout_service rollout_service
COPY workers workers
RUN pip install --no-cache-dir -e ".[swe]" && pip install --no-cache-dir --no-deps swebench==4.1.0
ENV ROLLOUT_STATE_DIR=/state
