"""Slurm as its command line shows it, for every part of runyard that drives Slurm (the control plane's
backend, the data stage's executor, `runyard reproduce`'s rerun): job states (the `JobState` squeue,
scontrol and sacct print), grouped the way runyard acts on them, and the parsers of scontrol's and
sacct's output."""

RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"})
QUEUED_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
                           "RESV_DEL_HOLD"})
# A job in one of these has not ended: its (array) tasks may still run or start.
LIVE_STATES = RUNNING_STATES | QUEUED_STATES


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o ID` output (one line of KEY=VALUE) as a dict."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def parse_sacct(text: str) -> dict[str, str] | None:
    """`sacct -X -n -P -o JobID,State,ExitCode` output -> {'State', 'ExitCode'} of the allocation."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0] and "." not in parts[0]:
            return {"State": parts[1].split()[0], "ExitCode": parts[2]}
    return None
