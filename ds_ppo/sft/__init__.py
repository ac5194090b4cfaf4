"""`ds-ppo sft`: supervised fine-tuning of the policy (RLHF's step 1): a task of the supervised job
(ds_ppo/jobs/supervised/training.py) that the run driver runs."""
from ds_ppo.sft.task import SFTTask

__all__ = ["SFTTask"]
