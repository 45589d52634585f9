"""The training layer: the TTT training loop, checkpoints, resume, data parallel."""
