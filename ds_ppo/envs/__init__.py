"""Environments for multi-turn rollouts (the `env` config section): the interface (`Step`,
base.py), running one over a batch of episodes (runner.py), an HTTP environment (http_env.py),
and the built-in example, a calculator tool (calculator.py); and task generators with
checkable answers (addition.py, the recipe's task). The episodes themselves are built in
ds_ppo/ppo/episodes.py."""
from ds_ppo.envs.base import EnvFailed, Step

__all__ = ["EnvFailed", "Step"]
