"""MLflow and TensorBoard mirrors of a run directory (the spec's `tracking:` section, `--tracking`).

The run directory stays the source of truth; runyard.tracking.mirror forwards what the run writes,
off the training thread. reader: what is sent, read from the run directory; sinks: the trackers.
"""
