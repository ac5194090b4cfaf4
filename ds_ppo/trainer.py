"""Old import path of the training loop, kept so that scripts using `from ds_ppo.run.loop import
train` keep working; the loop lives in `ds_ppo/run/loop.py`."""
from ds_ppo.run.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
