"""MLflow and TensorBoard mirrors of a run directory (the spec's `tracking:` section, `--tracking`).

The run directory stays the source of truth; the mirror forwards what the run writes, from a process of
its own. reader: what is sent, read from the run directory; sinks: the trackers; mirror: what is sent when,
with retries; process: the mirror's process, started and ended by rank 0.
"""
