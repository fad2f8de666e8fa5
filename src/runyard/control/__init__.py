"""The provider's control plane: a durable queue of jobs, device allocation, restarts, backends
(local processes, Slurm), and the agent that links it to the market. Imports no torch."""
