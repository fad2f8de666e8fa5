"""A lease's job runs inside bubblewrap (`bwrap`): the sandbox launcher and what the sandbox shows.

Why bubblewrap: it is one small program with no daemon (Flatpak's sandbox), in Debian and every
distribution (`apt-get install bubblewrap`), and it runs the host's own runtime read-only -- the
Python, the virtual environment and runyard the provider already has -- so a lease job needs no
image. It works unprivileged where user namespaces are enabled and set-uid where they are not, and
it runs inside a Slurm job step like any other command, so the same wrapped command works under
the local backend and on a cluster. podman needs images, subordinate ids and (rootless) a
per-user service; Apptainer needs images too and is not in Debian's archive.

Inside the sandbox a job sees:
- read-only: /usr (and the /bin, /lib, ... links into it) with /usr/local an empty folder, a few
  files of /etc (the dynamic linker's cache, the time zone, a passwd/group naming only the job's
  user), the least of the runtime (the interpreter file and its standard library, the virtual
  environment, runyard's package folder: `runyard.control.sandbox_runtime` says exactly what and
  why), and its lease folder (its spec, the demand's files and fetched URLs, see
  `runyard.control.lease_job`);
  a spec job runs in the demand's files folder, so its spec names them by the tenant's own paths;
- writable: only the lease's `work/` folder (its run directory, HOME, TMPDIR, caches), and an
  empty /tmp in memory (charged to the job's memory limit); everything else, the sandbox's own
  root included, is read-only;
- a private /proc (its own processes only), a minimal /dev, and for the GPUs allocated to it their
  device nodes, found by the GPUs' identity, and only the /sys entries the GPU runtime reads (their
  PCI devices, the nvidia modules: `runyard.control.gpu_nodes`), with the folders under /usr/local
  the dynamic linker's configuration names (a CUDA toolkit's libraries), nothing else;
- no network at all (a network namespace of its own, holding only loopback; the demand's data URLs
  are fetched by the launcher before the job starts, see `runyard.control.fetch`). A deployment's
  server (a standing lease) listens on that loopback, and its one way in is a Unix socket in the
  lease's work folder, which `runyard.control.serve_relay` connects to the server's port and only
  the agent's token-checking endpoint connects to from outside (`runyard.control.endpoint`);
- when the job carries an environment lock: that environment (built once per lock by the launcher,
  `runyard.control.lease_env`), read-only, and its python runs the job;
- an environment built from an allow-list: the control plane's variables for the attempt
  (RUNYARD_CONTROL_JOB, RUNYARD_JOB_ID, RUNYARD_RUN_DIR, RUNYARD_DEVICES, CUDA_VISIBLE_DEVICES,
  ...), fixed paths into its work folder, and the names the operator passes through
  (`--lease-env`); none of the daemon's own environment. bwrap itself (pid 1 inside) is started
  with that same clean environment, so /proc/1/environ shows nothing more.
- no capabilities, a new session (no terminal to inject into), separate IPC/UTS/cgroup namespaces;
  every process in it dies when the launcher dies (`--die-with-parent`), and the pid namespace
  ends with its first process, so nothing outlives the job.

The launcher (`python -m runyard.control.sandbox POLICY -- COMMAND...`, the command a lease's job
is queued with, see `wrap_argv`) runs outside the sandbox: it fetches the data URLs, applies the
lease's limits to itself (`runyard.control.limits`), starts bwrap in a process group of its own,
passes SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2 on to the sandbox's processes (so a preempted run can
checkpoint and exit 4), and exits with the job's exit code, or 5 when the job's cgroup says the kernel's
OOM killer ended it (a SIGKILL alone would read as the provider's fault). When it cannot run the job it writes
why to the lease folder's `failure.json` and exits 2, and the agent ends the lease with that reason.

With the operator setting `unconfined` (`runyard control start --unconfined-lease-jobs`) the
launcher runs the command without bwrap: the allow-listed environment and the limits still apply,
but files and network are NOT isolated. Only for a provider that cannot run bubblewrap and accepts
that risk; the agent refuses to start with lease jobs unconfined otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runyard.control import disk_quota, gpu_nodes, lease_env
from runyard.control import limits as job_limits
from runyard.control.disk_quota import DiskQuota, DiskShort
from runyard.control.fetch import FetchError, allowed_networks, fetch_all
from runyard.control.gpu_nodes import GpuBinds, GpuMappingError
from runyard.control.sandbox_runtime import USR_LOCAL, Runtime, SandboxUnavailable, runtime
from runyard.control.states import EXIT_DISK_QUOTA
from runyard.errors import EXIT_BAD_SPEC, EXIT_OUT_OF_MEMORY
from runyard.reproduce.errors import EnvironmentBuildFailed, ReproduceError
from runyard.system.files import atomic_write_text

BWRAP = "bwrap"
# The control plane's own variables for an attempt (see ControlLoop.job_env): not the daemon's secrets.
CONTROL_ENV = ("RUNYARD_CONTROL_JOB", "RUNYARD_JOB_ID", "RUNYARD_RESTART_COUNT", "RUNYARD_RUN_DIR",
               "RUNYARD_DEVICES", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
LD_SO_CONF = "/etc/ld.so.conf"
DEFAULT_TMPFS_BYTES = 1 << 30
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class SandboxPolicy:
    """What the launcher needs to run one lease's job (written by the agent as `sandbox.json`)."""

    lease_id: int
    root: str  # the lease folder (read-only inside)
    data_urls: dict[str, str] = field(default_factory=dict)  # URL -> file name under root/urls
    fetch: dict[str, str] = field(default_factory=dict)  # URL -> path under root (a deployment's export files)
    max_fetch_bytes: int = 1 << 30
    data_networks: list[str] = field(default_factory=list)  # CIDRs a data URL may reach besides public ones
    memory_bytes: int | None = None
    max_file_bytes: int | None = None
    pass_env: list[str] = field(default_factory=list)  # daemon variables the operator passes through
    unconfined: bool = False
    # The job's environment lock (a folder with requirements.txt and environment.json) and where its
    # environment is built: the job then runs that environment's python (runyard.control.lease_env).
    env_lock: str | None = None
    env_cache: str | None = None
    cwd: str | None = None  # where the job runs (inside the lease folder); default its work folder
    # The work folder's disk quota (runyard.control.disk_quota): none when disk_bytes is None.
    disk_bytes: int | None = None
    disk_files: int = 1_000_000
    disk_floor_bytes: int = 0  # the provider's free space this lease never takes the disk below
    disk_kernel: bool = True  # a filesystem of its own where the launcher can make one; False: the watchdog
    disk_interval_s: float = 1.0  # the watchdog's period

    @property
    def disk_quota(self) -> DiskQuota | None:
        return None if self.disk_bytes is None else DiskQuota(self.disk_bytes, self.disk_files, self.disk_floor_bytes)

    @property
    def tmpfs_bytes(self) -> int:
        """The size of the sandbox's /tmp and of its /dev/shm (each): its memory limit, which already
        bounds them together where a cgroup holds the job, else DEFAULT_TMPFS_BYTES."""
        return self.memory_bytes or DEFAULT_TMPFS_BYTES

    @property
    def job_cwd(self) -> Path:
        """Where the job runs: `cwd` (a spec job: the demand's files, which its spec names by relative
        paths), else its work folder."""
        return Path(self.cwd) if self.cwd and Path(self.cwd).is_dir() else self.work

    @property
    def work(self) -> Path:
        return Path(self.root) / "work"

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> SandboxPolicy:
        return cls(**json.loads(Path(path).read_text()))


def wrap_argv(argv: list[str], policy_path: str | Path) -> list[str]:
    """The command a lease's job is queued with: the launcher, which runs `argv` in the sandbox."""
    return [sys.executable, "-m", "runyard.control.sandbox", str(policy_path), "--", *argv]


def runtime_paths(python: str | None = None) -> list[str]:
    """The folders and files the sandbox binds read-only for `python`'s runtime (None: this one's,
    with runyard's package), see `runyard.control.sandbox_runtime`."""
    return runtime(python, package=python is None).ro


def usr_local_library_dirs(conf: str = LD_SO_CONF) -> list[str]:
    """The folders under /usr/local the dynamic linker's configuration names (a CUDA toolkit's, a
    driver's compat libraries): a GPU job's libraries may be there, and the linker's cache points in."""
    found: list[str] = []
    seen: set[str] = set()

    def read(path: str) -> None:
        if path in seen:
            return
        seen.add(path)
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            return
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if line.startswith("include "):
                pattern = line.split(None, 1)[1]
                base = Path(pattern if pattern.startswith("/") else str(Path(path).parent / pattern))
                for inc in sorted(base.parent.glob(base.name)):
                    read(str(inc))
            elif line.startswith(USR_LOCAL + "/") and os.path.isdir(line) and line not in found:
                found.append(line)

    read(conf)
    return found


def sandbox_env(policy: SandboxPolicy, parent: dict[str, str], python: Path | None = None) -> dict[str, str]:
    """The job's whole environment: control-plane variables, fixed paths, operator pass-throughs. With
    `python` (an environment built from the job's lock) its bin folder leads PATH and runyard comes
    from that environment, not from this provider's tree."""
    work = policy.work
    env = {name: parent[name] for name in (*CONTROL_ENV, *policy.pass_env) if name in parent}
    env.update(
        PATH=f"{Path(python or sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        HOME=str(work / "home"), TMPDIR=str(work / "tmp"), XDG_CACHE_HOME=str(work / "cache"),
        RUNYARD_CACHE_DIR=str(work / "cache" / "runyard"), LANG="C.UTF-8",
        PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",
    )
    if python is None:
        pythonpath = runtime().pythonpath  # the parent of runyard's package, where nothing else is shown
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
    return env


def allocated_devices(env: dict[str, str] | os._Environ) -> list[str]:
    """The attempt's devices: the control plane's allocation (RUNYARD_DEVICES), or, where a cluster
    allocated the GPUs (Slurm sets CUDA_VISIBLE_DEVICES for the job), those."""
    devices = [d for d in env.get("RUNYARD_DEVICES", "").split(",") if d]
    if not any(d.startswith("cuda:") for d in devices):
        devices += [f"cuda:{i}" for i in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.strip().isdigit()]
    return devices


def bwrap_argv(policy: SandboxPolicy, devices: list[str], command: list[str], info_fd: int | None = None,
               extra_ro: tuple[str, ...] = (), extra_rw: tuple[str, ...] = (), gpus: GpuBinds | None = None,
               shown: Runtime | None = None) -> list[str]:
    """The bwrap command line that runs `command` with only what the module docstring lists, and
    `extra_ro` read-only (an environment built from the job's lock), `extra_rw` writable (that
    environment while it is installed). `gpus`: the allocated GPUs' binds (default: found for
    `devices`, see `runyard.control.gpu_nodes`); `shown`: the runtime (default: this interpreter's)."""
    root, work = Path(policy.root), policy.work
    shown = shown or runtime()
    gpus = gpus if gpus is not None else gpu_nodes.find(devices)
    args = [BWRAP, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", f"lease-{policy.lease_id}", "--ro-bind", "/usr", "/usr"]
    # /usr/local: an empty folder (made read-only below); only what the runtime or a GPU's libraries
    # need of it is bound on it. A provider keeps its own builds and tools there.
    empty = [USR_LOCAL] if os.path.isdir(USR_LOCAL) and not os.path.islink(USR_LOCAL) else []
    args += [a for path in empty for a in ("--tmpfs", path)]
    # /tmp first: whatever lives under /tmp and must be seen (the runtime, when runyard or its venv sit
    # in /tmp; a lease folder, as in tests) is then mounted on top of the empty /tmp, not hidden by it.
    # Both tmpfs have a size: a job filling them meets ENOSPC, never the provider's memory (where no
    # cgroup bounds the job's memory, nothing else would).
    size = str(policy.tmpfs_bytes)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp",
             "--size", size, "--tmpfs", "/dev/shm"]
    for top in TOP_LINKS:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    args += ["--ro-bind", str(root / "passwd"), "/etc/passwd", "--ro-bind", str(root / "group"), "/etc/group"]
    for path in shown.ro:
        args += ["--ro-bind", path, path]
    for path, target in shown.links:
        args += ["--symlink", target, path]
    for path in shown.hidden:  # the base installation's site-packages, which the job's venv does not use
        args += ["--tmpfs", path]
    empty += shown.hidden
    args += ["--ro-bind", str(root), str(root), "--bind", str(work), str(work)]
    for path in extra_ro:
        args += ["--ro-bind", path, path]
    for path in extra_rw:
        args += ["--bind", path, path]
    if gpus.nodes:
        for node in gpus.nodes:
            args += ["--dev-bind-try", node, node]
        for path in gpus.sys_paths:  # /sys/bus/pci/devices/<id> is a link to the device's real folder
            real = os.path.realpath(path)
            args += ["--ro-bind-try", real, real]
            if real != path:
                args += ["--symlink", real, path]
        for path in usr_local_library_dirs():
            args += ["--ro-bind", path, path]
    # The sandbox's own root, /dev's tmpfs and the empty folders too: nothing writable but work/,
    # /tmp and /dev/shm.
    args += ["--remount-ro", "/", "--remount-ro", "/dev", *(a for path in empty for a in ("--remount-ro", path))]
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    return [*args, "--chdir", str(policy.job_cwd), "--", *command]


def probe(timeout_s: float = 60.0) -> None:
    """Run a trivial Python inside the sandbox as lease jobs get it; SandboxUnavailable if it fails."""
    if shutil.which(BWRAP) is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed; install it (Debian/Ubuntu: "
                                 "apt-get install bubblewrap)")
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"runyard-sandbox-probe-{os.getpid()}"
    try:
        for sub in ("work/tmp", "work/home"):
            (scratch / sub).mkdir(parents=True, exist_ok=True)
        for name in ("passwd", "group"):
            (scratch / name).write_text("")
        policy = SandboxPolicy(lease_id=0, root=str(scratch))
        argv = bwrap_argv(policy, [], [sys.executable, "-c", "import runyard.spec.job"])
        try:
            out = subprocess.run(argv, env=sandbox_env(policy, {}), capture_output=True, text=True,
                                 timeout=timeout_s, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"bubblewrap did not run: {exc}") from None
        if out.returncode != 0:
            raise SandboxUnavailable(f"bubblewrap cannot run a job here (exit {out.returncode}): "
                                     f"{(out.stderr or out.stdout).strip()[-500:]}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- the launcher -----------------------------------------------------------------------------------


def _fail(policy: SandboxPolicy, reason: str, code: int = EXIT_BAD_SPEC) -> int:
    print(f"runyard sandbox: {reason}", file=sys.stderr, flush=True)
    atomic_write_text(Path(policy.root) / "failure.json", json.dumps({"reason": reason, "at": time.time()}))
    return code


def _hold_disk(policy: SandboxPolicy) -> tuple[str | None, str | None]:
    """Put the work folder under its quota: (how, for the job's log; None without a quota) and, when
    the kernel cannot hold it, the reason the watchdog does instead. DiskShort: the floor forbids it."""
    quota = policy.disk_quota
    if quota is None:
        return None, None
    disk_quota.check_floor(policy.work, 0, quota.floor_bytes)
    why = disk_quota.kernel_means() if policy.disk_kernel else "the operator chose the watchdog"
    if why is None:
        try:
            return disk_quota.mount(policy.root, quota), None
        except (OSError, subprocess.SubprocessError) as exc:
            why = f"no filesystem of its own ({str(exc)[:300]})"  # the watchdog holds the job instead
    return f"disk quota {quota.describe()} by a watchdog every {policy.disk_interval_s:g}s ({why})", why


def _read_info(fd: int) -> dict:
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    os.close(fd)
    return json.loads(data) if data else {}


def launch(policy: SandboxPolicy, command: list[str]) -> int:
    """Fetch the job's data, apply its limits, run `command` in the sandbox; returns its exit code."""
    (Path(policy.root) / "failure.json").unlink(missing_ok=True)
    forwarder = _Forwarder()
    targets = {url: Path(policy.root) / "urls" / name for url, name in policy.data_urls.items()}
    targets.update({url: Path(policy.root) / rel for url, rel in policy.fetch.items()})
    try:
        for dest in targets.values():
            dest.parent.mkdir(parents=True, exist_ok=True)
        fetch_all(targets, policy.max_fetch_bytes, allowed_networks(policy.data_networks))
    except FetchError as exc:
        return _fail(policy, f"a data URL could not be fetched: {exc}")
    python = None
    if policy.env_lock:
        try:
            python = lease_env.ensure(Path(policy.env_lock), Path(policy.env_cache or Path(policy.root) / "envs"),
                                      install=lambda cmd, rw: _confined(policy, cmd, rw),
                                      say=lambda m: print(f"runyard sandbox: {m}", file=sys.stderr, flush=True))
        except (ReproduceError, OSError) as exc:
            return _fail(policy, f"the job's environment lock could not be built: {exc}")
        # The job's interpreter is the one the lock built (its runyard and versions, not ours).
        command = [str(python), *command[1:]] if command and command[0] == sys.executable else command
    if forwarder.pending:  # asked to stop while fetching or building: the job never starts
        return 128 + forwarder.pending[0]
    try:
        held, watched = _hold_disk(policy)
    except DiskShort as exc:  # the provider's own lack of space: its failure (a kill), not the tenant's
        return _fail(policy, str(exc), 128 + signal.SIGKILL)
    env = sandbox_env(policy, dict(os.environ), python)
    devices = allocated_devices(os.environ)
    gpus = GpuBinds()
    try:
        shown = runtime() if python is None else runtime(str(python), package=False)
        if not policy.unconfined:
            gpus = gpu_nodes.find(devices)
    except (SandboxUnavailable, GpuMappingError) as exc:  # this provider's setup, not the tenant's job
        return _fail(policy, str(exc), 128 + signal.SIGKILL)
    if gpus.visible:  # CUDA inside names the allocated GPUs by UUID: no index can mean another GPU
        env["CUDA_VISIBLE_DEVICES"] = gpus.visible
    limits = job_limits.Limits(memory_bytes=policy.memory_bytes, max_file_bytes=policy.max_file_bytes)
    cgroup = job_limits.cgroup_name(policy.root, policy.lease_id, os.environ.get("RUNYARD_JOB_ID", "x"))
    job_limits.apply(limits, devices, cgroup)
    if held:
        limits.applied.append(held)
    print(f"runyard sandbox: lease {policy.lease_id}, "
          f"{'UNCONFINED' if policy.unconfined else 'bubblewrap'}; limits: {'; '.join(limits.applied)}",
          file=sys.stderr, flush=True)
    oom_kills_before = job_limits.oom_kills(limits.cgroups)  # the cgroup is the job's across its attempts
    read_fd = write_fd = None
    if policy.unconfined:
        argv, cwd = command, str(policy.job_cwd)
    else:
        read_fd, write_fd = os.pipe()
        env_root = (str(Path(python).parent.parent.parent),) if python is not None else ()
        argv, cwd = bwrap_argv(policy, devices, command, info_fd=write_fd, extra_ro=env_root, gpus=gpus,
                               shown=shown), None
    try:
        # Its own process group: a signal to the launcher's group (the backend stopping the job)
        # reaches the launcher, which passes it on to the job's processes only (see _Forwarder).
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, process_group=0,
                                pass_fds=(write_fd,) if write_fd is not None else ())
    except OSError as exc:
        job_limits.leave_cgroups(limits.cgroups)
        return _fail(policy, f"the sandbox could not start: {exc}")
    target = proc.pid
    if write_fd is not None and read_fd is not None:
        os.close(write_fd)
        # bwrap names its sandbox's first process, which leads the session the job's processes are in.
        target = int(_read_info(read_fd).get("child-pid", proc.pid))
    job_limits.step_out(limits.cgroups)  # the job's processes stay in its cgroups; the launcher leaves
    forwarder.found(target)
    watchdog = None
    if held is not None and policy.disk_quota is not None:  # the floor always; the quota when no filesystem does
        watchdog = disk_quota.Watchdog(policy.work, policy.disk_quota, lambda: _kill(proc, target),
                                       policy.disk_interval_s, scan=watched is not None).start()
    code = proc.wait()
    code = 128 - code if code < 0 else code
    if watchdog is not None:
        watchdog.stop()
    why = job_limits.out_of_memory(code, oom_kills_before, limits.cgroups)
    job_limits.leave_cgroups(limits.cgroups)
    if watchdog is not None and watchdog.reason is not None:
        return _fail(policy, watchdog.reason, EXIT_DISK_QUOTA if watchdog.tenants else 128 + signal.SIGKILL)
    full = disk_quota.full(policy.work, policy.disk_quota) if code != 0 and held and not watched else None
    if full is not None and policy.disk_quota is not None:  # ENOSPC from its own filesystem: the tenant's
        return _fail(policy, full, EXIT_DISK_QUOTA)
    if why is not None:
        # A SIGKILL alone reads as the provider's fault (retried); the cgroup says it was the job's.
        print(f"runyard sandbox: {why.replace('memory limit', f'memory limit ({policy.memory_bytes} bytes)', 1)}; "
              "ask the lease for more memory", file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY
    return code


def _kill(proc: subprocess.Popen, target: int) -> None:
    """End the job now: its sandbox's processes (their group) and bwrap."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(target, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _confined(policy: SandboxPolicy, command: list[str], writable: Path) -> None:
    """Run `command` as a lease job would be run (no network, the provider's files hidden), with
    `writable` its only writable folder besides the lease's work area; EnvironmentBuildFailed with
    its output when it fails."""
    env = sandbox_env(policy, dict(os.environ))
    if policy.unconfined:
        argv, cwd = command, str(policy.work)
    else:
        # The install makes the venv with the lock's interpreter (build.json), which may be another one.
        build = writable / "build.json"
        interpreter = json.loads(build.read_text()).get("interpreter") if build.is_file() else None
        shown = runtime()
        if interpreter:
            try:
                shown = shown.merge(runtime(interpreter, package=False))
            except SandboxUnavailable as exc:
                raise EnvironmentBuildFailed(str(exc)) from None
        argv, cwd = bwrap_argv(policy, [], command, extra_rw=(str(writable),), gpus=GpuBinds(), shown=shown), None
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=lease_env.PIP_TIMEOUT_S)
    if proc.returncode != 0:
        raise EnvironmentBuildFailed(f"the confined install failed ({proc.returncode}): "
                                     f"{(proc.stderr or proc.stdout).strip()[-1500:]}")


class _Forwarder:
    """Passes stop signals on to the job's process group, holding any that come before it is known."""

    def __init__(self) -> None:
        self.target: int | None = None
        self.pending: list[int] = []
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.target is None:
            self.pending.append(signum)
        else:
            self._send(signum)

    def found(self, target: int) -> None:
        self.target = target
        for signum in self.pending:
            self._send(signum)

    def _send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.target, signum)  # type: ignore[arg-type]


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1 or len(argv) < 3:
        print("usage: python -m runyard.control.sandbox POLICY.json -- COMMAND [ARGS...]", file=sys.stderr)
        return EXIT_BAD_SPEC
    return launch(SandboxPolicy.load(argv[0]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
