"""Rollout-as-a-service: token-exact multi-turn agent rollouts for RL trainers."""

__version__ = "0.1.0"
