#!/usr/bin/env python3
"""A model's whole life on one machine, through the market: a market, one provider (a control plane and
its agent) and one tenant, all on loopback, with SQLite.

 1. the market starts; a provider and a tenant register and are verified; the tenant is funded;
 2. the provider lists capacity: a block of devices (training) and a standing allocation (serving);
 3. the tenant places a funded block demand carrying its job (examples/lifecycle/model.yaml and its
    data); the provider's agent runs it in its sandbox and delivers the run (export and evaluation);
 4. the tenant deploys the export on a standing lease; the provider serves it behind an endpoint that
    admits only the tenant's token, logging the traffic (PII-scrubbed) for the tenant;
 5. a client sends code completions through the endpoint with OpenAI's client, then switches to prose:
    the served model's drift monitor sees an episode;
 6. `runyard maintain` (the tenant's upkeep) buys one retraining on the market within its budget:
    the spec plus the logged traffic, starting from the served weights; the provider trains it and
    delivers it; fit to ship, it is rolled out on the same lease without a failed request;
 7. the tenant gives notice; the lease settles; `runyard market model-costs` says what the model has cost
    to train, retrain and serve, and the statement reconciles to the minor unit.

    python examples/lifecycle/lifecycle.py [--workdir DIR]

Every command it runs is printed as a user would type it. It writes DIR/summary.json with what was seen
(requests, failures, which export answered, episodes, retrainings, costs) and exits 0 only when the loop
closed: one retraining for the episode, rolled out, no failed request, the ledger balanced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from runyard.control import disk_quota, procs
from runyard.control.endpoint import EXPORT_HEADER
from runyard.control.rollout import export_digest
from runyard.control.store import JobStore
from runyard.system.http_thread import free_port
from runyard.system.processes import die_with_parent

HERE = Path(__file__).resolve().parent
PRICE = 36_000  # minor units per device-hour: 10 per device-second
BUDGET = 20_000  # a day's retraining budget: one retraining's escrow (36,000 x 1 device x 1,800 s = 18,000) fits once
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_FILES = [*sorted((STDLIB / "json").glob("*.py")), *(STDLIB / n for n in ("textwrap.py", "shlex.py", "csv.py"))]
PROSE = STDLIB / "LICENSE.txt"


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def runyard(*args: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    print("$ runyard " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "runyard", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)
    if check and done.returncode != 0:
        raise SystemExit(f"`runyard {' '.join(args[:3])}` exited {done.returncode}: {done.stderr[-3000:]}")
    return done


def answer(*args: str, **kwargs) -> dict:  # type: ignore[no-untyped-def]
    return json.loads(runyard(*args, **kwargs).stdout)


def background(log: Path, *args: str, cwd: Path | None = None) -> subprocess.Popen:
    print("$ runyard " + " ".join(args) + " &", flush=True)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "runyard", *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=cwd, preexec_fn=partial(die_with_parent, expected_parent=os.getpid()))


def until(what, timeout_s: float, every_s: float = 1.0, why: str = ""):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every_s)
    raise SystemExit(f"gave up after {timeout_s:g} s waiting for {why or what.__name__}")


class Files:
    """The tenant's files on an HTTP server (the object store a provider fetches exports from)."""

    def __init__(self, root: Path):
        handler = partial(SimpleHTTPRequestHandler, directory=str(root))
        handler.log_message = lambda *a: None  # type: ignore[method-assign]
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Traffic:
    """A client completing through the endpoint, counting failures and which export answered each time."""

    def __init__(self, url: str, token: str, prompts: list[str]):
        self.url, self.prompts = url, list(prompts)
        self.client = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=120)
        self.sent, self.failures, self.exports = 0, [], []  # type: ignore[var-annotated]
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def use(self, prompts: list[str]) -> None:
        with self.lock:
            self.prompts = list(prompts)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            with self.lock:
                prompt = self.prompts[i % len(self.prompts)]
            i += 1
            try:
                got = self.client.post(f"{self.url}/v1/completions",
                                       json={"model": "lifecycle", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                             "truncate_prompt_tokens": 48})  # the model's context is 64
                if got.status_code == 200:
                    self.exports.append(got.headers.get(EXPORT_HEADER))
                else:
                    self.failures.append(f"{got.status_code}: {got.text[:200]}")
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self.sent += 1
            time.sleep(0.05)

    def start(self) -> Traffic:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=120)


def code_prompts() -> list[str]:
    """Three-line chunks of the code the model trained on: the traffic it was made for."""
    texts = [path.read_text() for path in TRAIN_FILES]
    chunks = [t[i:i + 160] for t in texts for i in range(0, len(t) - 160, 160) if len(t[i:i + 160].split()) >= 3]
    random.Random(0).shuffle(chunks)  # a window of traffic looks like the whole corpus, not one file of it
    return chunks[:200]


def prose_prompts() -> list[str]:
    """Sentences of Python's licence: prose, another kind of text."""
    text = " ".join(PROSE.read_text().split())
    return [s.strip() + "." for s in text.split(".") if len(s.split()) >= 6][:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="where everything is kept (default: a new folder)")
    args = parser.parse_args()
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="ry-life-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tenant, provider = work / "tenant", work / "provider"
    for folder in (tenant / "data", provider):
        folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "model.yaml", tenant / "model.yaml")
    for path in TRAIN_FILES:
        shutil.copy(path, tenant / "data" / f"{path.parent.name}_{path.name}")
    started = time.monotonic()
    market = plane = upkeep = None
    summary: dict = {"workdir": str(work)}
    try:
        say("1. the market, a provider and a tenant")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        market = background(work / "market.log", "market", "serve", "--db", str(work / "market.db"), "--port",
                            str(port), "--dispute-window-s", "5", "--sweep-interval", "1", "--fee-bps", "250")
        until(lambda: _up(url), 60, 0.5, why="the market")
        db = str(work / "market.db")
        farm, lab = str(provider / "farm.json"), str(tenant / "lab.json")
        for name, role, identity in (("farm", "provider", farm), ("lab", "tenant", lab)):
            runyard("market", "register", name, "--role", role, "--url", url, "--identity", identity)
            runyard("market", "verify-request", "--evidence", "a walkthrough", "--identity", identity)
            runyard("market", "admin", "verify", "--db", db, name, "--approve", "--reason", "walkthrough")
        runyard("market", "admin", "credit", "--db", db, "--account", "lab", "--amount", "5000000", "--reason", "funds")

        say("2. the provider lists a block (training) and a standing allocation (serving), and starts its control plane")
        until_ = str(int(time.time()) + 86400)
        common = ["--identity", farm, "--accelerator-kind", "cpu", "--devices-per-node", "1", "--region", "local",
                  "--jurisdiction", "eu", "--price-per-device-hour", str(PRICE), "--available-until", until_]
        runyard("market", "list", *common, "--node-count", "2")
        runyard("market", "list", *common, "--node-count", "1", "--form", "standing", "--standing",
                json.dumps({"period_s": 60, "availability_bps": 9900, "credits": [], "notice_s": 0}))
        plane = background(work / "control.log", "control", "start", "--foreground", "--state-dir",
                           str(provider / "control"), "--market", url, "--provider-key", farm, "--cpu-slots", "4",
                           "--usage-interval", "2", "--probe-interval", "1", "--deliveries-root", str(tenant),
                           "--allow-data-network", "127.0.0.0/8")

        say("3. the tenant trains through a block lease")
        files = Files(tenant)
        job_files = [x for p in sorted((tenant / "data").glob("*.py")) for x in ("--job-file", f"data/{p.name}={p}")]
        first = tenant / "runs" / "first"
        demand = answer("market", "demand", "--identity", lab, "--kinds", "cpu", "--devices", "1", "--duration-s",
                        "1800", "--max-price", str(PRICE), "--job-spec", str(tenant / "model.yaml"), *job_files,
                        "--results-to", str(first))
        summary["training_demand"] = demand["id"]
        until(lambda: (first / ".runyard-delivery.json").is_file(), 600, 2, why="the trained run's delivery")
        report = json.loads((first / "eval" / "report.json").read_text())
        print(f"delivered: {first} (fit to ship: {report['fit_to_ship']})")
        # The work is done: end the lease now (usage so far is paid) rather than hold it to its window's end.
        runyard("market", "lease", "terminate", str(demand["lease_id"]), "--reason-code", "tenant_request", "--note",
                "delivered", "--identity", lab)

        say("4. the tenant deploys the export on a standing lease")
        export = first / "export"
        urls = [x for p in sorted(export.iterdir()) if p.is_file()
                for x in ("--export-url", f"{p.name}={files.url}/runs/first/export/{p.name}")]
        token_file = tenant / "endpoint.token"
        standing = answer("market", "demand", "--identity", lab, "--form", "standing", "--kinds", "cpu", "--devices",
                          "1", "--period-s", "60", "--max-price", str(PRICE), *urls, "--serve-option",
                          "model_name=lifecycle", "--serve-option", "kv_cache_mb=16", "--serve-option",
                          "log_requests=true", "--token-file", str(token_file))
        lease_id = standing["lease_id"]
        summary["serving_lease"] = lease_id
        lease = until(lambda: (lambda x: x if x["state"] == "running" and x["endpoint_url"] else None)(
            answer("market", "lease", "show", str(lease_id), "--identity", lab)), 600, 2, why="the deployment")
        endpoint, token = lease["endpoint_url"], token_file.read_text().strip()
        print(f"serving at {endpoint}")

        say("5. the tenant's upkeep starts; traffic flows: code first, then prose")
        upkeep = background(work / "maintain.log", "maintain", str(lease_id), "--identity", lab,
                            "--token-file", str(token_file), "--retrain-spec", "model.yaml", "--export", str(first),
                            "--budget", str(BUDGET), "--publish", str(tenant), files.url, "--without-env-lock",
                            "--min-logged", "30", "--poll-s", "2", "--deadline-s", "900", "--state-dir",
                            str(tenant / "upkeep"), cwd=tenant)
        traffic = Traffic(endpoint, token, code_prompts()).start()
        until(lambda: traffic.sent >= 80, 300, 1, why="80 code requests")
        traffic.use(prose_prompts())
        summary["prose_from_request"] = traffic.sent
        state_file = tenant / "upkeep" / "maintain.json"

        def upkeep_state() -> dict:
            return json.loads(state_file.read_text()) if state_file.is_file() else {}

        until(lambda: upkeep_state().get("retrainings"), 300, 2, why="a retraining demand on drift")
        print(f"drift episode bought a retraining: {upkeep_state()['retrainings'][0]}")

        say("6. the provider retrains; fit to ship, it is rolled out on the same lease")
        ended = until(lambda: (lambda r: r if r["state"] not in ("placing", "placed", "rolling_out") else None)(
            upkeep_state()["retrainings"][0]), 900, 3, why="the retraining to be delivered and rolled out")
        print(f"retraining: {ended['state']}: {ended.get('detail')}")
        new_digest = export_digest(Path(ended["results"]) / "export") if ended["state"] == "rolled_out" else None
        if new_digest:
            until(lambda: traffic.exports and traffic.exports[-1] == new_digest, 120, 1, why="the new model's answers")
        time.sleep(3)
        traffic.stop()

        say("7. notice, settlement, and what the model cost")
        runyard("market", "lease", "notice", str(lease_id), "--note", "walkthrough done", "--identity", lab)
        until(lambda: answer("market", "lease", "show", str(lease_id), "--identity", lab)["state"] == "settled",
              200, 2, why="the serving lease to settle")
        until(lambda: all(answer("market", "lease", "show", str(r["lease_id"]), "--identity", lab)["state"] == "settled"
                          for r in upkeep_state()["retrainings"] if r.get("lease_id")), 120, 2,
              why="the retraining lease to settle")
        costs = answer("market", "model-costs", "--identity", lab)
        statement = answer("market", "statement", "--identity", lab)
        audit = runyard("market", "admin", "audit", "--db", db, check=False)
        audit_ok = audit.returncode == 0 and audit.stdout.startswith("audit ok")
        print(audit.stdout.strip())
        print(json.dumps(costs, indent=1)[:3000])
        state = upkeep_state()
        summary.update(
            requests=traffic.sent, failures=traffic.failures, exports_served=_runs(traffic.exports),
            first_digest=export_digest(export), new_digest=new_digest, episodes=state["episodes"],
            retrainings=state["retrainings"], model_costs=costs, statement_totals=statement["totals"],
            audit_ok=audit_ok, seconds=round(time.monotonic() - started, 1))
        closed = (ended["state"] == "rolled_out" and not traffic.failures and statement["totals"].get("reconciles")
                  and audit_ok and len(state["retrainings"]) == 1)
        summary["loop_closed"] = bool(closed)
        print(f"\nloop closed: {bool(closed)}; {traffic.sent} requests, {len(traffic.failures)} failed; "
              f"{len(state['episodes'])} drift episode(s), {len(state['retrainings'])} retraining(s); "
              f"{summary['seconds']} s")
        return 0 if closed else 1
    except BaseException:
        _tell(work)  # what the provider saw, for whoever reads why it stopped
        raise
    finally:
        (work / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        for proc in (upkeep, plane, market):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
                if proc.poll() is None:
                    proc.kill()
        _leftovers(provider / "control")


def _tell(work: Path) -> None:
    """The last lines the provider's daemon and the upkeep wrote (their HTTP request lines left out)."""
    for name in ("control.log", "maintain.log"):
        path = work / name
        if path.is_file():
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if "HTTP Request" not in ln]
            print(f"\n-- the last lines of {path}:\n" + "\n".join(lines[-40:]), flush=True)


def _up(url: str) -> bool:
    try:
        httpx.get(f"{url}/healthz", timeout=2)
        return True
    except httpx.HTTPError:
        return False


def _runs(exports: list) -> list[list]:  # type: ignore[type-arg]
    """The exports that answered, as runs: [[digest, how many answers in a row], ...]."""
    out: list[list] = []  # type: ignore[type-arg]
    for digest in exports:
        if out and out[-1][0] == digest:
            out[-1][1] += 1
        else:
            out.append([digest, 1])
    return out


def _leftovers(control: Path) -> None:
    """What a stopped control plane leaves (its jobs' processes, lease work filesystems), removed."""
    with contextlib.suppress(Exception):
        for job in JobStore(control / "control.db").jobs():
            procs.kill_job_processes(procs.instance_id(control), job.id)
    for lease_root in control.glob("agent/lease-*"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            disk_quota.release(lease_root, remove_image=False)


if __name__ == "__main__":
    sys.exit(main())
