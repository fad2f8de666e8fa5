"""The Ray executor: each task a Ray task, retried by Ray up to `retries` times when its worker dies.

Where: the cluster at `--ray-address` (`ray://head:10001`, `auto`); without one, `ray.init()`'s own
choice: the cluster in $RAY_ADDRESS, else a Ray started on this machine for this preparation (data.workers
CPUs, no dashboard) and shut down with it. The data cache must be on storage every Ray node sees.

Ray is optional (`pip install 'runyard[ray]'`): it is imported here only, when this executor runs.
"""

from __future__ import annotations

from collections.abc import Callable

from runyard.data.errors import TaskFailed
from runyard.data.work_units import Task, run_task
from runyard.errors import DataError

# Tasks run side by side, one per CPU: each encodes on one thread (as the local executor's workers do).
_TASK_ENV = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _import_ray():
    try:
        import ray  # optional extra: only this executor needs Ray
    except ImportError:
        raise DataError("--executor ray needs Ray installed here (pip install 'runyard[ray]')") from None
    return ray


class RayExecutor:
    name = "ray"

    def __init__(self, address: str | None, memory_limit: int, retries: int = 2, workers: int | None = None):
        self.address, self.memory_limit, self.retries, self.workers = address, memory_limit, retries, workers
        self.task_cpu_s: dict[str, float] = {}  # step -> CPU seconds its tasks took, summed
        self._started = False  # whether this executor connected (and so disconnects, or stops its local Ray)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._started:
            _import_ray().shutdown()
            self._started = False

    def _connect(self, ray) -> None:
        if ray.is_initialized():
            return
        options = {"address": self.address, "log_to_driver": False, "runtime_env": {"env_vars": _TASK_ENV}}
        if self.address is None:  # may start a local Ray: size it to data.workers, without a dashboard
            options.update(include_dashboard=False, num_cpus=self.workers)
        try:
            ray.init(**options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise DataError(f"--executor ray: cannot reach Ray at {self.address or 'RAY_ADDRESS/local'}: {exc}") from None
        self._started = True

    def run(self, label: str, tasks: list[Task], on_done: Callable[[Task], None]) -> None:
        """Submit the tasks not yet done; each asks for one CPU and the memory limit."""
        ray = _import_ray()
        todo = [t for t in tasks if not t.done()]
        if not todo:
            return
        self._connect(ray)
        remote = ray.remote(num_cpus=1, memory=self.memory_limit, max_retries=self.retries)(run_task)
        pending = {remote.remote(t): t for t in todo}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                task = pending.pop(done[0])
                try:
                    cpu_s = ray.get(done[0])
                except ray.exceptions.RayError as exc:
                    raise TaskFailed(f"{label} task {task.index} ({task.output}) failed on Ray: {exc}") from None
                self.task_cpu_s[label] = self.task_cpu_s.get(label, 0.0) + cpu_s
                on_done(task)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
