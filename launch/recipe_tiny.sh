#!/usr/bin/env bash
# The recipe from a base model to an RLHF model on CPU (README: "From a base model to an RLHF
# model"): for each seed, SFT -> reward model -> GRPO (exact-match reward) and PPO (the learned
# reward model), and SFT -> DPO on the reward model's pairs, on the digit-sum task, with
# held-out exact-match accuracy before and after.
#   bash launch/recipe_tiny.sh                       # seeds 1 2 3 into outputs/recipe
#   bash launch/recipe_tiny.sh --seeds 1 --out /tmp/r
#   bash launch/recipe_tiny.sh --seeds 1 --steps sft,dpo   # SFT -> DPO only
set -euo pipefail
exec python -m ds_ppo.run.pipeline "$@"
