"""The msgpack codec of stored blobs: fields set in a stored document without decoding it."""

from __future__ import annotations

import random

from rollout_service.runtime.trajectory import TrajectoryBuilder
from rollout_service.schemas import FinishReason
from rollout_service.state.codec import Packed, pack, unpack, with_field


def stored_trajectory(seed: int) -> dict:
    rng = random.Random(seed)
    builder = TrajectoryBuilder([rng.randrange(50000) for _ in range(300)], [{"role": "user", "content": "reward"}])
    for _ in range(3):
        ids = [rng.randrange(150000) for _ in range(rng.randint(1, 400))]
        logprobs = [rng.choice([-rng.random() * 30, 0.0, -1e-300, float("-inf")]) for _ in ids]
        builder.add_generation(
            ids, logprobs, backend_id="be-reward", policy_version=seed, finish_reason="stop", latency_s=rng.random()
        )
        builder.add_observation([rng.randrange(150000) for _ in range(20)], 0.01)
    return builder.build(FinishReason.finished).model_dump(mode="json")


def test_setting_the_reward_of_a_stored_trajectory_changes_only_the_reward_bytes():
    for seed in range(20):
        document = stored_trajectory(seed)
        blob = pack(document)
        for reward in (1.0, 0.0, -0.5, None):
            patched = with_field(blob, "reward", reward)
            assert isinstance(patched, Packed) and patched == pack({**document, "reward": reward})
            back = unpack(patched)
            assert back["response_ids"] == document["response_ids"] and back["logprobs"] == document["logprobs"]


def test_a_document_without_the_field_gets_it_added():
    document = {k: v for k, v in stored_trajectory(1).items() if k != "reward"}
    assert unpack(with_field(pack(document), "reward", 1.0)) == {**document, "reward": 1.0}
