"""ds_ppo: PPO for large language models (RLHF) on DeepSpeed."""

__version__ = "0.1.0"
