"""The machine runyard runs on: processes that die with their parent (processes.py), durable file writes
(files.py), kernel locks (locking.py) and one writer per run directory (rundir.py), CPU threads, cgroups
and disk space (cpus.py, cgroup.py, diskspace.py), a loopback HTTP server thread (http_thread.py),
Slurm's command line (slurm.py) and progress on long work (progress.py). Standard library only (no torch): every layer above may import it.
"""
