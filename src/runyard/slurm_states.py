"""Slurm's job states (the `JobState` squeue, scontrol and sacct print), grouped the way runyard acts on
them: the control plane's Slurm backend (a job running, or queued again) and the data stage's Slurm
executor (an array that has not ended) read the same names."""

RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"})
QUEUED_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
                           "RESV_DEL_HOLD"})
# A job in one of these has not ended: its (array) tasks may still run or start.
LIVE_STATES = RUNNING_STATES | QUEUED_STATES
