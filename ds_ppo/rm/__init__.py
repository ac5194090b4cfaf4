"""`ds-ppo rm`: a reward model from preference pairs (RLHF's step 2): a task of the supervised job
(ds_ppo/jobs/supervised/training.py) that the run driver runs."""
from ds_ppo.rm.task import RMTask

__all__ = ["RMTask"]
