"""The model roles of a PPO run, named once (the planner, the templates and the engine import
them from here). Imports only the standard library."""
from __future__ import annotations

from typing import Literal

Role = Literal["policy", "value", "reference", "reward"]
ROLES: tuple[Role, ...] = ("policy", "value", "reference", "reward")
TRAINED_ROLES: tuple[Role, ...] = ("policy", "value")  # an optimizer: weights, gradients, Adam
INFERENCE_ROLES: tuple[Role, ...] = ("reference", "reward")  # forward passes only
