"""Reward sources: built-in functions (`functions.py`), loading and calling a user's
`module:function` (`call.py`), the HTTP reward service (`service.py`), and the re-encoding of
responses for a reward model with its own tokenizer (`encode.py`).

`ds_ppo.rewards:positive_words` and `ds_ppo.rewards:final_answer_match` (the names configs use)
and `ds_ppo.rewards.load_reward_function` keep working through the re-exports below.
"""
from ds_ppo.rewards.call import call_reward_function, check_scores, load_reward_function
from ds_ppo.rewards.functions import final_answer_match, positive_words

__all__ = ["call_reward_function", "check_scores", "final_answer_match", "load_reward_function",
           "positive_words"]
