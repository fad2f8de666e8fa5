"""Training: the loop, optimizer and schedule, parallelism, checkpoints, metrics."""
