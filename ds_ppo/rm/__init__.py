"""`ds-ppo rm`: a reward model from preference pairs (RLHF's step 2), on the run package's
supervised-job loop (ds_ppo/run/job_loop.py) and the engine's roles."""
from ds_ppo.rm.job import RMJob

__all__ = ["RMJob"]
