"""`ds-ppo sft`: supervised fine-tuning of the policy (RLHF's step 1), on the run package's
supervised-job loop (ds_ppo/run/job_loop.py) and the engine's roles."""
from ds_ppo.sft.job import SFTJob

__all__ = ["SFTJob"]
