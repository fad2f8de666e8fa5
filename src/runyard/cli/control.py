"""Verbs of the provider's control plane: `control start|stop|status|ui`, `submit`, `queue`, `job ...`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from runyard.control.agent import (
    DEFAULT_DISK_FILES_PER_DEVICE,
    DEFAULT_DISK_FLOOR_BYTES,
    DEFAULT_DISK_PER_DEVICE,
    LeaseJobSettings,
)
from runyard.control.client import ControlClient
from runyard.control.daemon import DaemonOptions, detect_inventory, run_daemon
from runyard.control.fetch import allowed_networks
from runyard.control.info import ControlError, read_daemon_info
from runyard.control.lease_retention import DEFAULT_KEEP_FINISHED_S
from runyard.control.loop import ControlConfig
from runyard.control.retry import ClassBudget, RetryPolicy
from runyard.control.states import JobState
from runyard.control.ui import serve_ui
from runyard.spec.job import load_spec

DEFAULT_STATE_DIR = os.environ.get("RUNYARD_CONTROL_DIR", str(Path.home() / ".runyard" / "control"))


def _state_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                        help="the control plane's state directory (env RUNYARD_CONTROL_DIR; default %(default)s)")


def register(subparsers: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    control = subparsers.add_parser("control", help="run the provider's control plane (a local job scheduler)")
    verbs = control.add_subparsers(dest="control_verb", metavar="ACTION", required=True)

    start = verbs.add_parser("start", help="start the control-plane daemon (loopback HTTP API + SQLite state)")
    _state_dir_arg(start)
    start.add_argument("--port", type=int, default=0, help="API port on 127.0.0.1 (default: any free port)")
    start.add_argument("--backend", choices=["local", "slurm"], default="local",
                       help="run jobs as local processes, or hand them to Slurm with sbatch")
    start.add_argument("--devices", help="devices to schedule, e.g. cuda:0,cuda:1 (default: the GPUs found)")
    start.add_argument("--cpu-slots", type=int, help="schedule N CPU slots instead of GPUs")
    start.add_argument("--max-concurrent", type=int, help="most jobs holding devices at once")
    start.add_argument("--quota", action="append", default=[], metavar="TENANT=N",
                       help="most devices TENANT may hold at once (repeatable)")
    start.add_argument("--no-preemption", action="store_true", help="never preempt lower-priority jobs")
    start.add_argument("--no-backfill", action="store_true", help="never start a job past a waiting one")
    start.add_argument("--stop-grace", type=float, default=60.0,
                       help="seconds between SIGTERM and SIGKILL on preemption or cancel (default 60)")
    start.add_argument("--infra-retries", type=int, default=10, help="restarts allowed after infra failures")
    start.add_argument("--user-retries", type=int, default=1, help="restarts allowed after user errors")
    start.add_argument("--retry-window", type=float, default=3600.0, help="seconds in which failures count")
    start.add_argument("--backoff", type=float, default=1.0, help="first restart delay in seconds (doubles)")
    start.add_argument("--slurm-partition", help="Slurm partition for sbatch (slurm backend)")
    start.add_argument("--slurm-gres", default="gpu",
                       help="GRES name of a device in Slurm (default gpu; empty: ask for CPUs instead)")
    start.add_argument("--market", help="market URL: run the agent that takes leases from it")
    start.add_argument("--provider-key", help="the provider's Ed25519 private key file (with --market)")
    start.add_argument("--usage-interval", type=float, default=30.0, help="seconds between usage reports")
    start.add_argument("--lease-jobs", help="directory of lease jobs (demand-<id>/spec.yaml) when the market "
                       "does not carry them (default: STATE_DIR/lease-jobs); results go to demand-<id>/results")
    start.add_argument("--deliveries-root", help="the folder a lease's results_to must lie in (default: "
                       "STATE_DIR/deliveries); a demand naming any other place is rejected and its escrow returned")
    start.add_argument("--allow-argv", action="store_true",
                       help="let the API queue arbitrary commands (JSON 'jobs' with argv), run as this daemon's "
                       "user, besides job specs; off by default")
    start.add_argument("--unconfined-lease-jobs", action="store_true",
                       help="run lease jobs without the bubblewrap sandbox where it cannot run (they then see "
                       "this machine's files and network); without it the daemon refuses to start so")
    start.add_argument("--allow-data-network", action="append", default=[], metavar="CIDR",
                       help="a network (e.g. 10.20.0.0/16) a lease's data URLs may reach besides public addresses "
                       "(repeatable; default: public addresses only, never loopback, private or link-local)")
    start.add_argument("--lease-memory-per-device", type=_byte_size, metavar="BYTES",
                       help="memory a lease job may use per device it leases, e.g. 16G (default: this "
                       "machine's memory over its devices)")
    start.add_argument("--lease-max-file-size", type=_byte_size, metavar="BYTES",
                       help="the largest file a lease job may write, e.g. 50G (default and at most: the "
                       "lease's disk quota; its checkpoints must fit)")
    start.add_argument("--lease-disk-per-device", type=_byte_size, default=DEFAULT_DISK_PER_DEVICE, metavar="BYTES",
                       help="a lease's disk quota per device it leases, e.g. 100G: the most its work folder (run "
                       "directory, HOME, TMPDIR, caches) may hold; a job past it stops as the tenant's failure "
                       "(exit 8, disk_quota) (default 50G)")
    start.add_argument("--lease-disk-files-per-device", type=_count, default=DEFAULT_DISK_FILES_PER_DEVICE,
                       metavar="N", help="the most files a lease's work folder may hold, per device it leases "
                       "(default %(default)d)")
    start.add_argument("--disk-floor", type=_byte_size, default=DEFAULT_DISK_FLOOR_BYTES, metavar="BYTES",
                       help="free space this machine keeps whatever its leases write, e.g. 20G: no lease is taken or "
                       "started below it, and a job that takes the disk below it is stopped (the provider's "
                       "failure, retried) (default 5G)")
    start.add_argument("--lease-disk-watchdog", action="store_true",
                       help="hold lease jobs to their disk quota with the launcher's watchdog (it totals the work "
                       "folder every second and stops the job past its quota; the overshoot is one second's "
                       "writes) instead of a loop-mounted filesystem of the quota's size, which the launcher "
                       "uses when it runs as root with mkfs.ext4 and mount")
    start.add_argument("--lease-max-fetch", type=_byte_size, default=1 << 30, metavar="BYTES",
                       help="the most a lease's data URLs may hold in all, e.g. 500M (default 1G)")
    start.add_argument("--lease-env", action="append", default=[], metavar="NAME",
                       help="pass this daemon's environment variable NAME through to lease jobs (repeatable); "
                       "they see no other of its variables")
    start.add_argument("--endpoint-host", default="127.0.0.1",
                       help="address the endpoints of deployments (models served through standing leases) listen "
                       "on, each on a port of its own; only the lease's tenant token is admitted (default %(default)s)")
    start.add_argument("--endpoint-public-host",
                       help="host name tenants reach those endpoints by, in the URL published on the lease "
                       "(default: --endpoint-host)")
    start.add_argument("--probe-interval", type=float, default=5.0,
                       help="seconds between health probes of a deployment: the evidence of its availability")
    start.add_argument("--unhealthy-restart", type=float, default=60.0,
                       help="restart a deployment whose server is alive but has failed its probes this many seconds")
    start.add_argument("--startup-grace", type=float, default=300.0,
                       help="seconds a deployment's server may take to load before failing probes counts")
    start.add_argument("--lease-env-cache", metavar="DIR",
                       help="where the environments of lease jobs that carry an environment lock are built, one "
                       "per lock hash (default: STATE_DIR/envs); one no job has used for 30 days is removed")
    start.add_argument("--keep-finished-leases", type=float, default=DEFAULT_KEEP_FINISHED_S, metavar="SECONDS",
                       help="how long a finished lease's folder (the tenant's spec, fetched data, run directory and "
                       "checkpoints) stays on this machine after the lease ends and its results are delivered; "
                       "then it is removed and its record kept (default %(default)g: 7 days; 0: at once)")
    start.add_argument("--foreground", action="store_true", help="run in this process instead of detaching")
    start.set_defaults(handler=_control_start)

    stop = verbs.add_parser("stop", help="stop the daemon (running jobs go on; a restart adopts them)")
    _state_dir_arg(stop)
    stop.set_defaults(handler=_control_stop)

    status = verbs.add_parser("status", help="is the daemon running, and how busy it is")
    _state_dir_arg(status)
    status.set_defaults(handler=_control_status)

    ui = verbs.add_parser("ui", help="the control plane's web console on loopback (sign in with its API token)")
    _state_dir_arg(ui)
    ui.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1", "::1", "localhost"],
                    help="the loopback address to bind (default %(default)s)")
    ui.add_argument("--port", type=int, default=8471, help="the console's port (default %(default)s)")
    ui.set_defaults(handler=lambda args: serve_ui(args.state_dir, args.host, args.port) or 0)

    submit = subparsers.add_parser("submit", help="queue a job spec on the control plane")
    submit.add_argument("spec", help="the job spec (YAML)")
    _state_dir_arg(submit)
    submit.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    submit.add_argument("--devices", type=int, help="devices for the job (default: the spec's resources.nproc)")
    submit.add_argument("--tenant", default="default", help="who the job is for (per-tenant quotas)")
    submit.add_argument("--run-dir", help="the run directory (default: one under the state directory)")
    submit.add_argument("--staged", action="store_true",
                        help="one job per stage, each starting only after the one before succeeded")
    submit.set_defaults(handler=_submit)

    queue = subparsers.add_parser("queue", help="list the control plane's jobs")
    _state_dir_arg(queue)
    queue.add_argument("--all", action="store_true", help="include finished jobs")
    queue.add_argument("--json", action="store_true", help="print JSON")
    queue.set_defaults(handler=_queue)

    job = subparsers.add_parser("job", help="inspect or act on one job")
    job_verbs = job.add_subparsers(dest="job_verb", metavar="ACTION", required=True)
    for name, fn, help_text in [
        ("show", _job_show, "a job's state, allocation, restarts and transitions"),
        ("logs", _job_logs, "a job's output"),
        ("cancel", _job_cancel, "stop a job (SIGTERM, then SIGKILL after the grace period)"),
        ("requeue", _job_requeue, "put a finished job back in the queue, or preempt a running one"),
    ]:
        p = job_verbs.add_parser(name, help=help_text)
        p.add_argument("id", type=int, help="the job id")
        _state_dir_arg(p)
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
        if name == "show":
            p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(handler=fn)


def _byte_size(text: str) -> int:
    """`16G`, `500M`, `1024` -> bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = text.strip().upper().rstrip("B").rstrip("I"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    if not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 1024, 500M or 16G")
    return int(number) * units[unit]


def _count(text: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number above 0")
    return int(text)


def _client(args: argparse.Namespace):

    return ControlClient.for_state_dir(args.state_dir)


def _options(args: argparse.Namespace):

    quotas = {}
    for item in args.quota:
        tenant, _, n = item.partition("=")
        if not tenant or not n.isdigit():
            raise ControlError(f"--quota {item!r}: expected TENANT=N")
        quotas[tenant] = int(n)
    policy = RetryPolicy(
        infra=ClassBudget(retries=args.infra_retries, backoff_s=args.backoff),
        user_error=ClassBudget(retries=args.user_retries, backoff_s=args.backoff),
        window_s=args.retry_window,
    )
    config = ControlConfig(
        state_dir=Path(args.state_dir).resolve(),
        inventory=detect_inventory(args.devices, args.cpu_slots),
        max_concurrent=args.max_concurrent, tenant_quotas=quotas, preemption=not args.no_preemption,
        backfill=not args.no_backfill, stop_grace_s=args.stop_grace, retry_policy=policy,
    )
    if args.market and not args.provider_key:
        raise ControlError("--market needs --provider-key (the key that signs acceptances and usage)")
    slurm = {"partition": args.slurm_partition, "gres": args.slurm_gres}
    try:
        allowed_networks(args.allow_data_network)
    except ValueError as exc:
        raise ControlError(f"--allow-data-network: {exc}") from None
    lease_settings = LeaseJobSettings(unconfined=args.unconfined_lease_jobs,
                                      data_networks=args.allow_data_network,
                                      max_fetch_bytes=args.lease_max_fetch,
                                      memory_per_device=args.lease_memory_per_device,
                                      max_file_bytes=args.lease_max_file_size, pass_env=args.lease_env,
                                      endpoint_host=args.endpoint_host, endpoint_public_host=args.endpoint_public_host,
                                      probe_interval_s=args.probe_interval, unhealthy_restart_s=args.unhealthy_restart,
                                      startup_grace_s=args.startup_grace, env_cache=args.lease_env_cache,
                                      keep_finished_s=args.keep_finished_leases,
                                      disk_per_device=args.lease_disk_per_device,
                                      disk_files_per_device=args.lease_disk_files_per_device,
                                      disk_floor_bytes=args.disk_floor, disk_kernel=not args.lease_disk_watchdog)
    return DaemonOptions(config=config, backend=args.backend, port=args.port, slurm=slurm,
                         market_url=args.market, provider_key=args.provider_key,
                         usage_interval_s=args.usage_interval, lease_jobs=args.lease_jobs,
                         deliveries_root=args.deliveries_root, lease_settings=lease_settings,
                         allow_argv=args.allow_argv)


def _control_start(args: argparse.Namespace) -> int:

    options = _options(args)  # validate before detaching, so errors reach this terminal
    if args.foreground:
        return run_daemon(options)
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "daemon.json").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "runyard", *[a for a in sys.argv[1:] if a != "--foreground"], "--foreground"]
    if sys.argv[1:3] != ["control", "start"]:  # called as a function, not from the command line
        argv = [sys.executable, "-m", "runyard", "control", "start", "--foreground",
                "--state-dir", str(state_dir), "--port", str(args.port), "--backend", args.backend]
    with open(state_dir / "daemon.log", "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ControlError(f"the control plane exited with {proc.returncode}; see {state_dir / 'daemon.log'}")
        try:
            info = read_daemon_info(state_dir)
            print(f"control plane running: pid {info['pid']}, http://{info['host']}:{info['port']}, "
                  f"devices {','.join(info['devices'])}")
            return 0
        except ControlError:
            time.sleep(0.1)
    raise ControlError(f"the control plane did not come up in 30 s; see {state_dir / 'daemon.log'}")


def _control_stop(args: argparse.Namespace) -> int:

    info = read_daemon_info(args.state_dir)
    _client(args).shutdown()
    for _ in range(100):
        try:
            os.kill(info["pid"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    print(f"control plane (pid {info['pid']}) stopped; running jobs go on and are adopted on restart")
    return 0


def _control_status(args: argparse.Namespace) -> int:
    client = _client(args)
    health, cap = client.health(), client.capacity()
    print(f"running ({health['backend']}): {len(cap['free'])}/{len(cap['inventory'])} devices free, "
          f"{cap['active_jobs']} active, {cap['pending_jobs']} pending")
    return 0


def _submit(args: argparse.Namespace) -> int:

    load_spec(args.spec)  # a bad spec is rejected here, before it is sent (exit 2); the daemon checks again
    text = Path(args.spec).read_text(encoding="utf-8")
    run_dir = str(Path(args.run_dir).resolve()) if args.run_dir else None
    jobs = _client(args).submit_spec(text, priority=args.priority, devices=args.devices, tenant=args.tenant,
                                     run_dir=run_dir, staged=args.staged)
    for job in jobs:
        after = f" after job {job['depends_on']}" if job["depends_on"] else ""
        print(f"job {job['id']} {job['name']}: pending on {job['devices']} device(s){after}; run dir {job['run_dir']}")
    return 0


def _queue(args: argparse.Namespace) -> int:

    states = None if args.all else [str(s) for s in JobState if not s.terminal]
    jobs = _client(args).jobs(states)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    print(f"{'ID':>5}  {'STATE':<11} {'PRI':>4} {'DEV':>3}  {'TENANT':<10} {'RESTARTS':>8}  NAME / DEVICES")
    for j in jobs:
        where = ",".join(j["allocation"]) or (j["failure"] or "")
        print(f"{j['id']:>5}  {j['state']:<11} {j['priority']:>4} {j['devices']:>3}  {j['tenant'][:10]:<10} "
              f"{j['restart_count']:>8}  {j['name']} {where}")
    return 0


def _job_show(args: argparse.Namespace) -> int:
    data = _client(args).job(args.id)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    j = data["job"]
    print(f"job {j['id']} {j['name']}: {j['state']}" + (f" ({j['failure']}: {j['detail']})" if j["failure"] else ""))
    print(f"  tenant {j['tenant']}, priority {j['priority']}, {j['devices']} device(s) {','.join(j['allocation'])}")
    print(f"  restarts {j['restart_count']}, attempts {j['attempt']}, device-seconds {j['device_seconds']:.1f}")
    print(f"  run dir {j['run_dir']}\n  log {j['log_path']}\n  command {' '.join(j['argv'])}")
    for t in data["history"]:
        stamp = time.strftime("%H:%M:%S", time.localtime(t["at"]))
        print(f"  {stamp} {t['from_state'] or '-':>10} -> {t['to_state']:<10} by {t['actor']}: {t['reason']}")
    return 0


def _job_logs(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.follow:
        for text in client.follow_logs(args.id):
            sys.stdout.write(text)
            sys.stdout.flush()
        return 0
    offset = 0
    while True:
        chunk = client.logs(args.id, offset)
        sys.stdout.write(chunk["text"])
        if not chunk["text"]:
            return 0
        offset = chunk["offset"]


def _job_cancel(args: argparse.Namespace) -> int:
    job = _client(args).cancel(args.id)
    print(f"job {job['id']}: {job['state']}")
    return 0


def _job_requeue(args: argparse.Namespace) -> int:
    job = _client(args).requeue(args.id)
    print(f"job {job['id']}: {job['state']}")
    return 0
