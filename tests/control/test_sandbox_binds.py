"""What a lease job's sandbox shows, listed: a real job inside bubblewrap walks the filesystem and
tries the provider's secrets, and everything it can read lies within the allowed set (/usr less
/usr/local, a few /etc files, the interpreter, its standard library, the venv, runyard's package
folder, its lease folder); GPUs are mapped to device nodes by identity, from recorded nvidia-smi
and driver outputs (fixtures/gpus), and only their /sys entries are bound."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

import pytest

import runyard
from runyard.control import gpu_nodes, sandbox_runtime
from runyard.control.gpu_nodes import GpuBinds, GpuMappingError
from runyard.control.sandbox import bwrap_argv

from .test_sandbox import SECRET, provider, run_job  # noqa: F401 -- the provider fixture

GPUS = Path(__file__).parent / "fixtures" / "gpus"
REPO = Path(__file__).resolve().parents[2]

WALK = r"""
import json, os, sys
allowed = json.loads(sys.argv[1]); candidates = json.loads(sys.argv[2])
def inside(p, root): return p == root or p.startswith(root.rstrip("/") + "/")
def readable(p):
    try:
        if os.path.isdir(p): os.listdir(p)
        else: open(p, "rb").read(1)
        return True
    except OSError:
        return False
seen, stack = [], ["/"]
while stack:
    d = stack.pop()
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if p in ("/proc", "/dev") or any(inside(p, r) for r in allowed):
            continue  # private to the sandbox, or allowed whole
        if not readable(p):
            continue
        seen.append(p)
        if os.path.isdir(p) and not os.path.islink(p):
            stack.append(p)
pids = [pid for pid in os.listdir("/proc") if pid.isdigit()]
def environ(pid):
    try:
        return open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return b""
others = [pid for pid in pids if sys.argv[4].encode() in environ(pid)]
print(json.dumps({"seen": seen, "readable": [c for c in candidates if readable(c)], "procs_of_others": others, "pids": pids, "usr_local": sorted(os.listdir("/usr/local")) if os.path.isdir("/usr/local") else None,
                  "hidden_site": sorted(os.listdir(sys.argv[3])) if sys.argv[3] and os.path.isdir(sys.argv[3]) else None}))
"""


def _expected_runtime() -> tuple[list[str], list[str]]:
    """The allowed runtime, worked out here from the interpreter itself: (shown whole, links on the way)."""
    shown = [sysconfig.get_path("stdlib"), os.path.dirname(os.path.realpath(runyard.__file__))]
    if sys.prefix != sys.base_prefix:
        shown.append(sys.prefix)
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        shown.append(os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")))
    links, path = [], sys.executable
    while os.path.islink(path):
        links.append(path)
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    shown.append(path)
    return [p for p in shown if not p.startswith("/usr/") or p.startswith("/usr/local/")], links


def test_a_job_can_read_only_the_allowed_set(sandboxed, provider):  # noqa: F811
    root, state, folder = provider["root"], provider["state"], provider["folder"]
    runtime, links = _expected_runtime()
    etc = ["/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives",
           "/etc/passwd", "/etc/group"]
    allowed = ["/usr", *runtime, *etc, str(folder.root), "/tmp", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
               "/libx32"]
    candidates = [str(Path.home()), str(Path.home() / ".bash_history"), "/root", "/home", "/etc/shadow",
                  str(REPO / ".git"), str(REPO / "pyproject.toml"), str(REPO / "tests"), str(REPO),
                  str(Path(sys.prefix).parent / ".git"), str(state / "api-token"), str(state / "control.db"),
                  str(state / "agent" / "lease-8" / "files" / "theirs.txt"), str(root / "provider" / "secrets.txt"),
                  "/usr/local/bin", "/usr/local/lib", "/usr/local/cuda", "/sys", "/var", "/opt", "/srv",
                  str(Path(sys.executable).parent.parent.parent), os.path.realpath(sys.base_prefix),
                  f"/proc/{os.getppid()}/environ"]
    base_site = os.path.join(sysconfig.get_path("stdlib"), "site-packages")
    hidden = base_site if sys.prefix != sys.base_prefix and os.path.isdir(base_site) else ""
    out = run_job(folder, WALK, json.dumps(allowed), json.dumps(candidates), hidden, SECRET)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    # Outside the allowed roots only the folders leading to them (made empty by bubblewrap) and the
    # links on the way to the interpreter can be read.
    leading = {str(p) for r in allowed for p in Path(r).parents}
    beyond = [p for p in report["seen"] if p not in leading and p not in links]
    assert beyond == [], f"the sandbox shows more than the allowed set: {beyond}"
    readable = [c for c in report["readable"]
                if not any(c == r or c.startswith(r + "/") for r in runtime) and c not in leading]
    assert readable == [], f"readable in the sandbox: {readable}"
    # Its own processes only (bwrap and the job): none holds the daemon's environment (with SECRET).
    assert report["procs_of_others"] == [] and len(report["pids"]) <= 3, report["pids"]
    # /usr/local holds only what the runtime lives in there (here: nothing), never the provider's tools.
    assert report["usr_local"] in (None, sorted({p.split("/")[3] for p in runtime if p.startswith("/usr/local/")}))
    if hidden:
        assert report["hidden_site"] == []  # the base installation's packages, which the venv does not use
    # No home, checkout or /usr/local is shown whole, whatever the layout of this machine.
    for path in runtime:
        assert not any(h == path or h.startswith(path + "/") for h in ("/root", "/home", str(Path.home())))
        assert not (Path(path) / ".git").exists() and path not in ("/usr/local", str(REPO), str(REPO / "src"))


def test_the_runtime_shown_is_the_least_the_interpreter_needs():
    shown = sandbox_runtime.runtime()
    runtime, links = _expected_runtime()
    assert sorted(shown.ro) == sorted(sandbox_runtime._outermost(runtime))
    assert [p for p, _ in shown.links] == [p for p in links if not any(p.startswith(r + "/") for r in shown.ro)]
    pkg = os.path.dirname(os.path.realpath(runyard.__file__))
    if not pkg.startswith(sys.prefix + "/"):  # imported from a checkout: its package folder only
        assert pkg in shown.ro and shown.pythonpath == os.path.dirname(pkg)


@pytest.mark.parametrize("folder", ["/", "/root", "/home", str(Path.home()), str(REPO)])
def test_a_folder_holding_a_home_or_a_checkout_is_never_shown(folder):
    if not os.path.isdir(folder):
        pytest.skip(f"{folder} is not on this machine")
    with pytest.raises(sandbox_runtime.SandboxUnavailable, match="must not see it"):
        sandbox_runtime.check_shown(folder)


def test_usr_local_is_an_empty_read_only_folder_in_the_sandbox(provider):  # noqa: F811
    argv = bwrap_argv(provider["policy"], ["cpu:0"], ["true"], gpus=GpuBinds())
    at = argv.index("/usr/local")
    assert argv[at - 1] == "--tmpfs" and at < argv.index(sandbox_runtime.runtime().ro[0])  # binds land on it
    assert "/usr/local" in [argv[i + 1] for i, a in enumerate(argv) if a == "--remount-ro"]
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"]
    assert "/usr/local" not in binds and "/sys" not in argv


def _information(bus_id: str) -> str:
    return (GPUS / f"information-{bus_id.split(':')[1]}.txt").read_text()


def test_gpus_are_mapped_to_device_nodes_by_identity():
    gpus = gpu_nodes.parse_query((GPUS / "query-4xh100.csv").read_text())
    assert [(g.index, g.bus_id) for g in gpus] == [(0, "0000:18:00.0"), (1, "0000:2a:00.0"), (2, "0000:3a:00.0"),
                                                   (3, "0000:5d:00.0")]
    # nvidia-smi index 1 is the driver's minor 3 and index 3 its minor 0: not /dev/nvidia1 and /dev/nvidia3.
    binds = gpu_nodes.plan(["1", "3"], gpus, _information)
    assert [n for n in binds.nodes if n not in gpu_nodes.CONTROL_NODES] == ["/dev/nvidia3", "/dev/nvidia0"]
    assert binds.visible == "GPU-a2d4f6b8-1c3e-4a5b-8d7f-9e0a1b2c3d4e,GPU-77aa88bb-99cc-4dde-8eff-00112233aabb"
    assert binds.sys_paths[:2] == ["/sys/bus/pci/devices/0000:2a:00.0", "/sys/bus/pci/devices/0000:5d:00.0"]
    # A UUID (as Slurm may set in CUDA_VISIBLE_DEVICES) names the same GPU.
    assert gpu_nodes.plan(["GPU-77aa88bb-99cc-4dde-8eff-00112233aabb"], gpus, _information).nodes[-1] == "/dev/nvidia0"
    assert gpu_nodes.allocated_gpus(["cuda:1", "cpu:0", "cuda:GPU-x"]) == ["1", "GPU-x"]
    assert gpu_nodes.plan([], gpus, _information) == GpuBinds()


def test_what_cannot_be_mapped_is_refused_with_the_reason():
    gpus = gpu_nodes.parse_query((GPUS / "query-4xh100.csv").read_text())
    with pytest.raises(GpuMappingError, match="allocated GPU '7' is none of the driver's GPUs"):
        gpu_nodes.plan(["7"], gpus, _information)
    with pytest.raises(GpuMappingError, match="no 'Device Minor'"):
        gpu_nodes.device_minor("Model: NVIDIA H100\nBus Location: 0000:2a:00.0\n")
    with pytest.raises(GpuMappingError, match="line 1 .*expected 'index, uuid, pci.bus_id'"):
        gpu_nodes.parse_query("0, 00000000:18:00.0\n")
    with pytest.raises(GpuMappingError, match="not a PCI bus id"):
        gpu_nodes.normalise_bus_id("18:00")
    assert gpu_nodes.normalise_bus_id("00000001:AB:1F.3") == "0001:ab:1f.3"


def test_only_the_gpus_own_sys_entries_and_nodes_enter_the_sandbox(provider):  # noqa: F811
    gpus = gpu_nodes.plan(["1"], gpu_nodes.parse_query((GPUS / "query-4xh100.csv").read_text()), _information)
    argv = bwrap_argv(provider["policy"], ["cuda:1"], ["true"], gpus=gpus)
    nodes = [argv[i + 1] for i, a in enumerate(argv) if a == "--dev-bind-try"]
    assert "/dev/nvidia3" in nodes and "/dev/nvidiactl" in nodes and "/dev/nvidia1" not in nodes
    binds = [argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--ro-bind-try", "--symlink")]
    assert "/sys" not in binds and "/sys" not in argv
    assert all(not p.startswith("/sys/") or p.startswith(("/sys/bus/pci/devices/0000:2a:00.0", "/sys/module/nvidia"))
               or "0000:2a:00.0" in p for p in binds)


def test_without_the_nvidia_driver_no_gpu_is_bound():
    if gpu_nodes.PROC_GPUS.parent.exists():
        pytest.skip("this machine has the NVIDIA driver")
    assert gpu_nodes.find(["cuda:0", "cuda:1"]) == GpuBinds()
