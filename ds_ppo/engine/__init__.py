"""The one place that talks to DeepSpeed: distributed set-up, engines per role (behind the role
objects the stages call, role_objects.py), the hybrid generation step, checkpoints and exports.
Nothing outside this package imports deepspeed (tests/unit/test_imports.py)."""
