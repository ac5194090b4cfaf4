#!/usr/bin/env bash
# The recipe from a base model to an RLHF model on CPU (README: "From a base model to an RLHF
# model"): for each seed, SFT -> reward model -> GRPO (exact-match reward) and PPO (the learned
# reward model) on the digit-sum task, with held-out exact-match accuracy before and after RL.
#   bash launch/recipe_tiny.sh                       # seeds 1 2 3 into outputs/recipe
#   bash launch/recipe_tiny.sh --seeds 1 --out /tmp/r
set -euo pipefail
exec python -m ds_ppo.run.pipeline "$@"
