"""The model roles of a PPO run, named once (the planner, the templates and the engine import
them from here). Imports only the standard library."""
from __future__ import annotations

from typing import Literal

Role = Literal["policy", "value", "reference", "reward", "teacher"]
ROLES: tuple[Role, ...] = ("policy", "value", "reference", "reward", "teacher")
TRAINED_ROLES: tuple[Role, ...] = ("policy", "value")  # an optimizer: weights, gradients, Adam
# teacher: on-policy distillation's (ppo.advantage_estimator = distill)
INFERENCE_ROLES: tuple[Role, ...] = ("reference", "reward", "teacher")  # forward passes only
