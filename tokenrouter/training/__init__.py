"""Offline router training: R2R-style labels from the model pair, task-outcome labels, fitting, calibration to a
share or a recall, checkpoints (`python -m tokenrouter.training.train`, `python -m tokenrouter.training.calibrate`).
The serving policies in `tokenrouter.policies` only load what this writes."""
