"""The Ray executor: each task a Ray task on the cluster at a given address (`ray://head:10001`,
`auto`), retried by Ray up to `retries` times when its worker dies. Ray is optional: it is imported
here only, when this executor runs, and the data cache must be on storage every Ray node sees.
"""

from __future__ import annotations

from collections.abc import Callable

from runyard.data.errors import TaskFailed
from runyard.data.tasks import Task, run_task
from runyard.errors import DataError


class RayExecutor:
    name = "ray"

    def __init__(self, address: str, memory_limit: int, retries: int = 2):
        self.address, self.memory_limit, self.retries = address, memory_limit, retries

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, label: str, tasks: list[Task], on_done: Callable[[Task], None]) -> None:
        """Submit the tasks not yet done to the cluster; each asks for one CPU and the memory limit."""
        try:
            import ray  # optional: only this executor needs Ray (pip install ray)
        except ImportError:
            raise DataError("--executor ray needs Ray installed here (pip install 'ray[default]')") from None
        todo = [t for t in tasks if not t.done()]
        if not todo:
            return
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False)
        remote = ray.remote(num_cpus=1, memory=self.memory_limit, max_retries=self.retries)(run_task)
        pending = {remote.remote(t): t for t in todo}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                task = pending.pop(done[0])
                try:
                    ray.get(done[0])
                except ray.exceptions.RayError as exc:
                    raise TaskFailed(f"{label} task {task.index} ({task.output}) failed on Ray: {exc}") from None
                on_done(task)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
