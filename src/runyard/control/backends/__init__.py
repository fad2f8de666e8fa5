"""Backends run a job's attempts: `local` (processes on this machine) or `slurm` (sbatch)."""
