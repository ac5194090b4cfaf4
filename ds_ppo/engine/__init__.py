"""The one place that talks to DeepSpeed: distributed set-up, engines per role, the hybrid
generation step, and checkpoints. Nothing outside this package imports deepspeed."""
