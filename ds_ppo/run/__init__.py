"""The run around a training job: the loop (`loop.train`), reporting, MLflow tracking and the
model registry, the run directory, stop signals, progress/ETA, logging set-up and export."""
