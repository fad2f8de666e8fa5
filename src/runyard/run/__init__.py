"""Executing a run: execute.py is the spine (plan, data, gated stages, evaluation, export) of every
task; predictive.py the tabular and image runs it hands over once the run directory is locked;
preflight.py the checks before any work; continuation.py opening a run directory for a new or edited
spec."""
