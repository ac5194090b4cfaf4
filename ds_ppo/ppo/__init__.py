"""The PPO iteration's stages: rollout (generation), scoring, advantages, update, and the
held-out evaluation; `iteration.run_iteration` strings them together. Training jobs other than
PPO (SFT, reward model) are siblings of this package and share engine/, data/, config/ and run/.
"""
