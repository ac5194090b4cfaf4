"""The run around a training job: the driver (`driver.run`), reporting, MLflow tracking and the
model registry, the run directory, stop signals, progress/ETA, logging set-up and export."""
