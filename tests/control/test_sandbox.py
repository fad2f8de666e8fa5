"""A lease's job inside the sandbox, as real processes: the launcher (`python -m runyard.control.sandbox`)
running bubblewrap around hostile code that tries to read the provider's files, read the daemon's
environment, write outside its folder and open sockets -- each attempt fails and nothing of the
provider's reaches the job -- while what a job may do (read its files, write its work folder)
works; the lease's limits hold; stop signals reach the job; nothing outlives a killed launcher."""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runyard.control import limits as job_limits
from runyard.control import procs
from runyard.control.lease_job import LeaseFolder, write_files
from runyard.control.sandbox import SandboxPolicy, allocated_devices, bwrap_argv, wrap_argv
from runyard.control.states import FailureReason, classify_exit
from runyard.errors import EXIT_OUT_OF_MEMORY
from runyard.system.processes import popen_dying_with_me

SECRET = "provider-secret-4242"
MARKER_INSTANCE = "sandboxtest"


@pytest.fixture
def provider(tmp_path):
    """A provider's machine in miniature: a secrets file, a state dir with the API token and another
    lease's folder, and lease 7's folder with the tenant's data."""
    (tmp_path / "provider").mkdir()
    (tmp_path / "provider" / "secrets.txt").write_text(SECRET)
    state = tmp_path / "state"
    (state / "agent").mkdir(parents=True)
    (state / "api-token").write_text(SECRET)
    other = LeaseFolder(state / "agent" / "lease-8").create()
    write_files(other, {"theirs.txt": SECRET.encode()})
    folder = LeaseFolder(state / "agent" / "lease-7").create()
    write_files(folder, {"train.txt": b"the tenant's own data\n"})
    folder.spec.write_text("name: mine\n")
    policy = SandboxPolicy(lease_id=7, root=str(folder.root), memory_bytes=256 << 20)
    policy.save(folder.policy)
    return {"root": tmp_path, "state": state, "folder": folder, "policy": policy}


def run_job(folder: LeaseFolder, script: str, *args: str, job_id: int = 1, devices: str = "cpu:0",
            timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -c script args...` as a lease job through the launcher, as the control plane would:
    with the daemon's environment (holding a secret) plus the attempt's control variables."""
    env = {**os.environ, "RUNYARD_TEST_SECRET": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET,
           "RUNYARD_DEVICES": devices, "RUNYARD_JOB_ID": str(job_id),
           "RUNYARD_CONTROL_JOB": procs.marker(MARKER_INSTANCE, job_id, 1)}
    return subprocess.run(wrap_argv([sys.executable, "-c", script, *args], folder.policy), env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_job_reads_its_files_and_writes_its_work_folder(sandboxed, provider):
    folder = provider["folder"]
    out = run_job(folder, "import os, sys\n"
                  "data = open(os.path.join(sys.argv[1], 'train.txt')).read()\n"
                  "open('run/out.txt', 'w').write(data.upper())\n"
                  "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]\n"
                  "print(os.getcwd(), os.environ['HOME'], os.environ['RUNYARD_DEVICES'], caps)", str(folder.files))
    assert out.returncode == 0, out.stderr
    assert (folder.run_dir / "out.txt").read_text() == "THE TENANT'S OWN DATA\n"
    # No capabilities at all, even when the provider runs as root.
    assert out.stdout.split() == [str(folder.work), str(folder.work / "home"), "cpu:0", "0" * 16]
    assert "runyard sandbox: lease 7, bubblewrap" in out.stderr


READ_PROVIDER_FILES = """
import os, sys
for path in sys.argv[1:]:
    try:
        print("LEAKED", path, open(path).read()[:100])
        sys.exit(0)
    except OSError as exc:
        print("blocked", path, exc.strerror)
sys.exit(1)
"""

READ_DAEMON_ENV = """
import os, sys
secret = sys.argv[1]
if any(secret in v for v in os.environ.values()):
    print("LEAKED os.environ"); sys.exit(0)
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        if secret.encode() in open(f"/proc/{pid}/environ", "rb").read():
            print("LEAKED", pid); sys.exit(0)
    except OSError:
        pass
print("environment:", sorted(os.environ)); sys.exit(1)
"""

WRITE_OUTSIDE = """
import os, sys
wrote = []
for path in sys.argv[1:]:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as fh:
            fh.write("pwned")
        wrote.append(path)
    except OSError as exc:
        print("blocked", path, exc.strerror)
print("wrote (inside the sandbox's view):", wrote)
sys.exit(0 if wrote else 1)
"""

OPEN_SOCKETS = """
import socket, sys
port = int(sys.argv[1])
for target in [("127.0.0.1", port), ("1.1.1.1", 80), ("8.8.8.8", 53)]:
    try:
        socket.create_connection(target, timeout=3).sendall(b"LEAK")
        print("CONNECTED", target); sys.exit(0)
    except OSError as exc:
        print("blocked", target, exc.strerror)
sys.exit(1)
"""


class _Listener:
    """A real TCP server on the provider's loopback that records every connection it gets."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


def test_a_hostile_job_cannot_read_the_providers_files(sandboxed, provider):
    root, state = provider["root"], provider["state"]
    targets = [root / "provider" / "secrets.txt", state / "api-token",
               state / "agent" / "lease-8" / "files" / "theirs.txt", Path("/etc/shadow"),
               Path(f"/proc/{os.getpid()}/environ"), Path.home() / ".bash_history"]
    for target in targets[:3]:  # they are there to be read, outside the sandbox
        assert SECRET in target.read_text()
    out = run_job(provider["folder"], READ_PROVIDER_FILES, *map(str, targets))
    assert out.returncode == 1 and "LEAKED" not in out.stdout and SECRET not in out.stdout, out.stdout
    assert out.stdout.count("blocked") == len(targets)


def test_a_hostile_job_cannot_read_the_daemons_environment(sandboxed, provider):
    out = run_job(provider["folder"], READ_DAEMON_ENV, SECRET)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "LEAKED" not in out.stdout
    seen = ast.literal_eval(out.stdout.split("environment:", 1)[1].strip())  # a printed list of names
    assert "AWS_SECRET_ACCESS_KEY" not in seen and "RUNYARD_TEST_SECRET" not in seen
    assert {"RUNYARD_CONTROL_JOB", "RUNYARD_JOB_ID", "RUNYARD_DEVICES", "HOME", "PATH"} <= set(seen)


def test_a_hostile_job_cannot_write_outside_its_work_folder(sandboxed, provider):
    folder, root = provider["folder"], provider["root"]
    runtime_file = Path(sys.prefix) / "pyvenv.cfg"
    before = {p: p.read_bytes() for p in (folder.spec, folder.files / "train.txt", folder.policy, runtime_file)}
    targets = [root / "provider" / "pwned.txt", folder.spec, folder.files / "train.txt", folder.policy,
               runtime_file, Path("/usr/lib/pwned"), Path("/etc/pwned")]
    out = run_job(folder, WRITE_OUTSIDE, *map(str, targets))
    assert all(p.read_bytes() == data for p, data in before.items()), "a read-only file changed"
    assert not (root / "provider" / "pwned.txt").exists() and not Path("/usr/lib/pwned").exists()
    assert not Path("/etc/pwned").exists()
    # What it did write went to the sandbox's own throw-away /tmp, not to the provider's disk.
    assert str(root / "provider" / "pwned.txt") in out.stdout.split("wrote (inside the sandbox's view):")[1]
    assert out.stdout.count("blocked") == len(targets) - 1


def test_a_hostile_job_cannot_open_a_socket(sandboxed, provider):
    listener = _Listener()
    probe = socket.create_connection(("127.0.0.1", listener.port), timeout=5)  # the service is up
    probe.close()
    deadline = time.monotonic() + 5
    while listener.connections < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.connections == 1
    out = run_job(provider["folder"], OPEN_SOCKETS, str(listener.port))
    assert out.returncode == 1 and "CONNECTED" not in out.stdout, out.stdout
    assert out.stdout.count("blocked") == 3
    time.sleep(0.2)
    assert listener.connections == 1, "the sandboxed job reached the provider's loopback service"
    listener.sock.close()


def test_the_lease_memory_limit_holds(sandboxed, provider):
    grab = "import sys; b = bytearray(int(sys.argv[1])); b[::4096] = b'x' * len(b[::4096]); print('held', len(b))"
    small = run_job(provider["folder"], grab, str(32 << 20))
    assert small.returncode == 0 and "held" in small.stdout, small.stderr
    big = run_job(provider["folder"], grab, str(1 << 30))  # four times the lease's 256 MiB
    assert big.returncode != 0 and "held" not in big.stdout
    assert "memory 268435456" in big.stderr or "RLIMIT_DATA 268435456" in big.stderr
    if "memory 268435456" in big.stderr:  # a cgroup: the kernel's OOM killer ended it, and the launcher says so
        assert big.returncode == EXIT_OUT_OF_MEMORY, big.stderr
        assert "went past its memory limit (268435456 bytes)" in big.stderr
        assert classify_exit(big.returncode, None) == (None, FailureReason.OUT_OF_MEMORY)


def test_filling_tmpfs_past_the_memory_limit_is_the_tenants_out_of_memory(sandboxed, provider):
    # Files in /tmp or /dev/shm are charged to the job's cgroup like its heap; the job's own heap stays small.
    fill = ("import sys\nwith open(sys.argv[1] + '/fill', 'wb') as f:\n"
            "    for _ in range(1024): f.write(b'x' * (1 << 20)); f.flush()\nprint('filled')")  # fmt: skip
    for where in ("/tmp", "/dev/shm"):
        out = run_job(provider["folder"], fill, where)
        assert out.returncode != 0 and "filled" not in out.stdout, (where, out.stderr)
        if "memory 268435456" in out.stderr:  # a cgroup, as above
            assert out.returncode == EXIT_OUT_OF_MEMORY, (where, out.stderr)
            assert classify_exit(out.returncode, None) == (None, FailureReason.OUT_OF_MEMORY)


# Recorded from a cgroup v2 job killed by the OOM killer after filling /dev/shm (shmem high, anon low).
EVENTS_BEFORE = "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"
EVENTS_AFTER = "low 0\nhigh 0\nmax 1187\noom 3\noom_kill 2\noom_group_kill 0\n"
STAT_SHMEM = "anon 2101248\nfile 266874880\nkernel 1970176\nshmem 266338304\nfile_mapped 0\nfile_dirty 0\n"
STAT_HEAP = "anon 266592256\nfile 45056\nkernel 1503232\nshmem 0\nfile_mapped 0\n"
# cgroup v1: the memory controller's memory.oom_control and memory.stat.
OOM_CONTROL_V1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"
STAT_V1 = "cache 266338304\nrss 2101248\nshmem 266338304\ntotal_shmem 266338304\n"


def _cgroup(folder: Path, **files: str) -> Path:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)
    return folder


@pytest.mark.parametrize("stat", [STAT_SHMEM, STAT_HEAP])
def test_an_oom_kill_of_the_jobs_cgroup_is_the_tenants_whatever_filled_it(tmp_path, stat):
    before = _cgroup(tmp_path / "before", memory_events=EVENTS_BEFORE, memory_stat=stat)
    kills = job_limits.oom_kills([before])
    (before / "memory.events").write_text(EVENTS_AFTER)
    why = job_limits.out_of_memory(137, kills, [before])  # SIGKILL: on its own, the provider's (retried)
    assert why is not None and "exit 137" in why
    assert ("in tmpfs" in why) == (stat is STAT_SHMEM)
    assert classify_exit(137, None) == (None, FailureReason.INFRA)  # what the launcher's answer replaces
    assert classify_exit(EXIT_OUT_OF_MEMORY, None) == (None, FailureReason.OUT_OF_MEMORY)
    v1 = _cgroup(tmp_path / "v1", memory_oom_control=OOM_CONTROL_V1, memory_stat=STAT_V1)
    assert "266338304 bytes of it in tmpfs" in (job_limits.out_of_memory(137, 0, [v1]) or "")


def test_no_oom_kill_no_out_of_memory(tmp_path):
    quiet = _cgroup(tmp_path / "quiet", memory_events=EVENTS_AFTER, memory_stat=STAT_SHMEM)
    assert job_limits.out_of_memory(137, 2, [quiet]) is None  # killed, but not by the OOM killer this time
    assert job_limits.out_of_memory(0, 0, [quiet]) is None  # a child was killed, the job went on and succeeded
    assert job_limits.out_of_memory(137, 0, []) is None  # no cgroup: nothing says it was memory


def test_the_launcher_steps_out_of_the_jobs_cgroup(tmp_path):
    parent = tmp_path / "parent"
    job = _cgroup(parent / "job", cgroup_procs="")
    (parent / "cgroup.procs").write_text("")
    job_limits.step_out([job])
    assert (parent / "cgroup.procs").read_text() == str(os.getpid())


def test_the_largest_file_a_job_may_write_is_bounded(sandboxed, provider):
    folder, policy = provider["folder"], provider["policy"]
    policy.max_file_bytes = 1 << 20
    policy.save(folder.policy)
    write = "import sys; open('run/big', 'wb').write(b'x' * int(sys.argv[1])); print('wrote')"
    assert run_job(folder, write, str(1 << 19)).returncode == 0
    big = run_job(folder, write, str(4 << 20))
    assert big.returncode != 0 and "wrote" not in big.stdout and "RLIMIT_FSIZE 1048576" in big.stderr
    assert (folder.run_dir / "big").stat().st_size <= 1 << 20


def test_cpu_slots_become_the_jobs_cores(sandboxed, provider):
    out = run_job(provider["folder"], "import os; print(sorted(os.sched_getaffinity(0)))", devices="cpu:1")
    cores = sorted(os.sched_getaffinity(0))
    assert out.returncode == 0 and json.loads(out.stdout) == [cores[1 % len(cores)]]


def _launch(folder: LeaseFolder, script: str, job_id: int) -> subprocess.Popen:
    env = {**os.environ, "RUNYARD_DEVICES": "cpu:0", "RUNYARD_JOB_ID": str(job_id),
           "RUNYARD_CONTROL_JOB": procs.marker(MARKER_INSTANCE, job_id, 1)}
    return popen_dying_with_me(wrap_argv([sys.executable, "-c", script], folder.policy), env=env,
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_sigterm_reaches_the_job_which_checkpoints_and_exits_4(sandboxed, provider):
    folder = provider["folder"]
    script = ("import signal, sys, time\n"
              "def stop(*_):\n    open('run/checkpointed', 'w').write('yes'); sys.exit(4)\n"
              "signal.signal(signal.SIGTERM, stop)\nopen('run/ready', 'w').close()\ntime.sleep(120)")
    proc = _launch(folder, script, job_id=2)
    _wait_for(folder.run_dir / "ready")
    proc.send_signal(signal.SIGTERM)  # as the backend stops a job: the launcher passes it on
    assert proc.wait(60) == 4, proc.stdout.read()
    assert (folder.run_dir / "checkpointed").read_text() == "yes"


def test_nothing_outlives_a_killed_launcher(sandboxed, provider):
    folder = provider["folder"]
    # The job's child has no parent-death signal on purpose: the sandbox, not the kernel's signal, must end it.
    script = ("import subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
              "open('run/ready', 'w').close()\ntime.sleep(300)")
    proc = _launch(folder, script, job_id=3)
    _wait_for(folder.run_dir / "ready")
    inside = procs.processes_of_job(MARKER_INSTANCE, 3)
    assert len(inside) >= 3  # bwrap, the job, its child: all carry the attempt's marker
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while procs.processes_of_job(MARKER_INSTANCE, 3):
        assert time.monotonic() < deadline, f"left behind: {procs.processes_of_job(MARKER_INSTANCE, 3)}"
        time.sleep(0.05)
    # The killed launcher could not leave its cgroups; the agent removes them when the lease ends (a
    # cgroup still counting an exiting process is busy for a moment: the agent's sweep comes back to it).
    name = job_limits.cgroup_name(folder.root, 7, 3)
    deadline = time.monotonic() + 30
    while list(Path("/sys/fs/cgroup").glob(f"*/{name}")):
        assert time.monotonic() < deadline, "the killed launcher's cgroups were never removable"
        job_limits.remove_stale(name)
        time.sleep(0.1)
    assert job_limits.remove_stale(name) == 0


def test_unconfined_mode_keeps_the_environment_clean_but_not_the_files(provider):
    """--unconfined-lease-jobs (for a provider that cannot run bubblewrap): the allow-listed environment
    and the limits still apply; the provider's files are NOT hidden -- which is why it is opt-in."""
    folder, policy = provider["folder"], provider["policy"]
    policy.unconfined = True
    policy.save(folder.policy)
    env_out = run_job(folder, READ_DAEMON_ENV, SECRET)
    assert "LEAKED os.environ" not in env_out.stdout
    files_out = run_job(folder, READ_PROVIDER_FILES, str(provider["root"] / "provider" / "secrets.txt"))
    assert files_out.returncode == 0 and "LEAKED" in files_out.stdout
    assert "UNCONFINED" in files_out.stderr


def test_the_attempts_devices_come_from_the_control_plane_or_the_cluster():
    assert allocated_devices({"RUNYARD_DEVICES": "cuda:2,cuda:3", "CUDA_VISIBLE_DEVICES": "2,3"}) == ["cuda:2", "cuda:3"]
    assert allocated_devices({"RUNYARD_DEVICES": "", "CUDA_VISIBLE_DEVICES": "1"}) == ["cuda:1"]  # Slurm's GRES
    assert allocated_devices({"RUNYARD_DEVICES": "cpu:0,cpu:1", "CUDA_VISIBLE_DEVICES": ""}) == ["cpu:0", "cpu:1"]


def test_a_cpu_job_gets_no_gpu_node_and_no_sys(provider):
    """GPU jobs: tests/control/test_sandbox_binds.py (their nodes mapped by identity)."""
    cpu = bwrap_argv(provider["policy"], ["cpu:0"], ["true"])
    assert "--dev-bind-try" not in cpu and "/sys" not in cpu
    assert "--unshare-all" in cpu and "--share-net" not in cpu and "--die-with-parent" in cpu


def test_the_daemon_refuses_to_take_leases_it_cannot_confine(tmp_path):
    """Where bubblewrap cannot run (here: not on PATH), a daemon with a market does not start, unless
    the operator explicitly lets lease jobs run unconfined."""
    argv = [sys.executable, "-m", "runyard", "control", "start", "--foreground", "--state-dir", str(tmp_path / "s"),
            "--cpu-slots", "1", "--market", "http://127.0.0.1:9", "--provider-key", str(tmp_path / "none.json")]
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused.stderr
    assert "bubblewrap (bwrap) is not installed" in refused.stderr and "--unconfined-lease-jobs" in refused.stderr
    assert not (tmp_path / "s" / "daemon.json").exists()
    allowed = subprocess.run([*argv, "--unconfined-lease-jobs"], env=env, capture_output=True, text=True, timeout=60)
    assert "lease jobs run UNCONFINED" in allowed.stderr  # it goes on past the sandbox ...
    assert allowed.returncode == 1 and "cannot read market identity" in allowed.stderr  # ... to the key file
    assert not (tmp_path / "s" / "daemon.json").exists()
