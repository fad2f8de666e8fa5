"""Roll-outs through the market, end to end: a tenant's standing lease serves one tiny export in the
provider's sandbox; the tenant asks (`runyard market deployment rollout`) for another; the provider's
agent starts it beside the running server, switches the endpoint once it answers and stops the old
one. A client sending requests all through sees no failure, and every answer says which export
served it (X-Runyard-Export): the old one until the switch, the new one after. A roll-out to an
export that does not load fails with the server's own words and the old export keeps serving; a
roll-back returns to the export served before. Exactly one server serves the lease after each; and an
agent killed (SIGKILL of the provider's daemon) in the middle of a roll-out leaves exactly one server
behind the endpoint once it is started again."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from runyard.control.endpoint import EXPORT_HEADER
from runyard.control.info import read_daemon_info
from runyard.control.rollout import export_digest
from runyard.market.server import ServerThread
from runyard.market.service import Market, Settings
from runyard.market.serving import deployment_body
from runyard.market.verifiers import OperatorVerifier
from runyard.model.hf.export import export_model
from tests.control.helpers import require_sandbox
from tests.model.small_model import make_model, tokenizer, tokenizer_path  # noqa: F401 (fixtures)

from .leases import ControlPlane, FileServer, parties, runyard, serve_processes, until

pytestmark = pytest.mark.slow
PRICE = 36_000
PERIOD = 600


@pytest.fixture
def short_dir():
    """A state directory with a short path (a deployment's unix socket lives under it)."""
    path = Path(tempfile.mkdtemp(prefix="ry-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Traffic:
    """A client thread completing through the endpoint, counting failures and which export answered."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url, token
        self.failures: list[str] = []
        self.exports: list[str | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {self.token}"}, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    answer = client.post(f"{self.url}/v1/completions",
                                         json={"model": "tiny", "prompt": "def add", "max_tokens": 3, "temperature": 0})
                    if answer.status_code != 200:
                        self.failures.append(f"{answer.status_code}: {answer.text[:200]}")
                    else:
                        self.exports.append(answer.headers.get(EXPORT_HEADER))
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def _serving_exports(folder: Path) -> list[str]:
    """The export folders `runyard serve` processes of this lease serve now."""
    return [export for _, export in serve_processes() if export.startswith(str(folder))]


def test_a_tenant_rolls_out_and_back_through_the_market_without_a_failed_request(
        tmp_path, short_dir, tokenizer, tokenizer_path, make_model):  # noqa: F811
    require_sandbox()
    exports = tmp_path / "exports"
    made = {}
    for seed in (0, 1):
        model = make_model(tokenizer, seed=seed)
        made[seed] = export_model(model, model.cfg, tokenizer_path, exports / f"run{seed}" / "export",
                                  extra_config={"run_name": f"tiny{seed}"})
    digests = {seed: export_digest(path) for seed, path in made.items()}
    assert digests[0] != digests[1]
    broken = tmp_path / "broken" / "export"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")

    market = Market.open(str(tmp_path / "market.db"), Settings(test_clock=True, dispute_window_s=30, fee_bps=250),
                         verifier=OperatorVerifier())
    files = FileServer(exports)
    plane = None
    with ServerThread(market) as server:
        ops, people = parties(market, server.url)
        farm, lab = people["farm"], people["lab"]
        farm.save_identity(tmp_path / "farm.json")
        lab.save_identity(tmp_path / "lab.json")
        now = ops.market_info()["now"]
        farm.create_listing(accelerator_kind="cpu", devices_per_node=1, node_count=1, region="eu-west",
                            jurisdiction="eu", price_per_device_hour=PRICE, available_until=now + 86400,
                            form="standing", standing={"period_s": PERIOD, "availability_bps": 9950, "credits": [],
                                                       "notice_s": 0})
        ops.credit("lab", 2_000_000, "test funds")
        # Two device slots: the lease holds one, a roll-out's new server takes the other beside it.
        plane = ControlPlane(short_dir / "control", server.url, tmp_path / "farm.json", "--cpu-slots", "2",
                             "--usage-interval", "1", "--probe-interval", "0.5", "--allow-data-network", "127.0.0.0/8")
        try:
            urls = {p.name: f"{files.url}/run0/export/{p.name}" for p in sorted(made[0].iterdir()) if p.is_file()}
            body, token = deployment_body(urls=urls, serve={"kv_cache_mb": 8, "model_name": "tiny"})
            lease_id = lab.place_demand({"accelerator_kinds": ["cpu"], "device_count": 1}, PRICE, form="standing",
                                        standing={"period_s": PERIOD}, deployment=body)["lease_id"]
            lease = until(lambda: (lambda x: x if x["state"] == "running" and x["endpoint_url"] else None)(
                lab.lease(lease_id)), 300)
            folder = short_dir / "control" / "agent" / f"lease-{lease_id}"
            endpoint = lease["endpoint_url"]

            def verb(*args: str) -> object:
                return runyard("market", "deployment", *args, "--identity", str(tmp_path / "lab.json"),
                               "--url", server.url, timeout=400)

            with Traffic(endpoint, token) as traffic:
                until(lambda: traffic.exports and traffic.exports[-1] == digests[0], 120)
                start = len(traffic.exports)  # from here every answer names the export that gave it
                # 1. Roll out the second export (uploaded by the verb): the switch fails no request.
                out = verb("rollout", str(lease_id), str(made[1].parent), "--wait", "300")
                assert out.returncode == 0, out.stdout + out.stderr
                done = lab.rollouts(lease_id)[-1]
                assert (done["state"], done["export_digest"]) == ("switched", digests[1]), done
                until(lambda: traffic.exports[-1] == digests[1], 60)
                first_new = traffic.exports.index(digests[1])
                assert first_new >= start and set(traffic.exports[start - 1:first_new]) == {digests[0]}
                until(lambda: len(_serving_exports(folder)) == 1, 120)  # the old server stopped
                assert _serving_exports(folder)[0].startswith(str(folder / "exports"))

                # 2. An export that does not load: the roll-out fails with the server's words; nothing changes.
                seen = len(traffic.exports)
                out = verb("rollout", str(lease_id), str(broken), "--wait", "300")
                assert out.returncode == 1, out.stdout + out.stderr
                failed = lab.rollouts(lease_id)[-1]
                assert failed["state"] == "failed" and "before it served" in failed["detail"], failed
                until(lambda: len(traffic.exports) > seen + 2, 60)
                assert set(traffic.exports[first_new:]) == {digests[1]}

                # 3. Roll back: the first export again.
                out = verb("rollback", str(lease_id), "--wait", "300")
                assert out.returncode == 0, out.stdout + out.stderr
                back = lab.rollouts(lease_id)[-1]
                assert (back["kind"], back["state"], back["export_digest"]) == ("rollback", "switched", digests[0])
                until(lambda: traffic.exports[-1] == digests[0], 60)
                until(lambda: len(_serving_exports(folder)) == 1, 120)
            assert traffic.failures == [], traffic.failures[:5]
            assert len(traffic.exports) > 10
            listed = runyard("market", "deployment", "rollouts", str(lease_id), "--identity", str(tmp_path / "lab.json"),
                             "--url", server.url)
            assert listed.returncode == 0 and listed.stdout.count('"state"') == 3, listed.stdout + listed.stderr
            assert base64.b64decode(lab.rollouts(lease_id)[0]["export"]["export_files"]["config.json"])
        except BaseException:
            print(plane.log())
            raise
        finally:
            plane.stop()
            files.close()
    market.store.dispose()


@pytest.mark.full
def test_an_agent_killed_during_a_roll_out_leaves_exactly_one_server_after_its_restart(
        tmp_path, short_dir, tokenizer, tokenizer_path, make_model):  # noqa: F811
    require_sandbox()
    made = {}
    for seed in (0, 1):
        model = make_model(tokenizer, seed=seed)
        made[seed] = export_model(model, model.cfg, tokenizer_path, tmp_path / "exports" / f"run{seed}" / "export",
                                  extra_config={"run_name": f"tiny{seed}"})
    market = Market.open(str(tmp_path / "market.db"), Settings(test_clock=True, dispute_window_s=30, fee_bps=250),
                         verifier=OperatorVerifier())
    files = FileServer(tmp_path / "exports")
    state = short_dir / "control"
    flags = ("--cpu-slots", "2", "--usage-interval", "1", "--probe-interval", "0.5", "--allow-data-network",
             "127.0.0.0/8")
    plane = None
    with ServerThread(market) as server:
        ops, people = parties(market, server.url)
        farm, lab = people["farm"], people["lab"]
        farm.save_identity(tmp_path / "farm.json")
        farm.create_listing(accelerator_kind="cpu", devices_per_node=1, node_count=1, region="eu-west",
                            jurisdiction="eu", price_per_device_hour=PRICE,
                            available_until=ops.market_info()["now"] + 86400, form="standing",
                            standing={"period_s": PERIOD, "availability_bps": 9950, "credits": [], "notice_s": 0})
        ops.credit("lab", 2_000_000, "test funds")
        plane = ControlPlane(state, server.url, tmp_path / "farm.json", *flags)
        try:
            urls = {p.name: f"{files.url}/run0/export/{p.name}" for p in sorted(made[0].iterdir()) if p.is_file()}
            body, token = deployment_body(urls=urls, serve={"kv_cache_mb": 8, "model_name": "tiny"})
            lease_id = lab.place_demand({"accelerator_kinds": ["cpu"], "device_count": 1}, PRICE, form="standing",
                                        standing={"period_s": PERIOD}, deployment=body)["lease_id"]
            until(lambda: lab.lease(lease_id)["state"] == "running", 300)
            folder = state / "agent" / f"lease-{lease_id}"
            record = state / "agent" / f"lease-{lease_id}.json"
            new = {p.name: f"{files.url}/run1/export/{p.name}" for p in sorted(made[1].iterdir()) if p.is_file()}
            asked = lab.request_rollout(lease_id, export_urls=new)

            # Killed once its new server is queued beside the old one, before any switch.
            until(lambda: (json.loads(record.read_text()).get("rollout") or {}).get("phase") == "check", 120)
            os.kill(read_daemon_info(state)["pid"], signal.SIGKILL)
            plane = ControlPlane(state, server.url, tmp_path / "farm.json", *flags)  # started again

            done = until(lambda: (lambda r: r if r["state"] != "requested" else None)(
                next(r for r in lab.rollouts(lease_id) if r["id"] == asked["id"])), 300)
            assert done["state"] == "switched" and done["export_digest"] == export_digest(made[1]), done
            until(lambda: len(_serving_exports(folder)) == 1, 120)
            assert _serving_exports(folder)[0].startswith(str(folder / "exports"))
            endpoint = lab.lease(lease_id)["endpoint_url"]
            with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
                answer = until(lambda: (lambda r: r if r.status_code == 200 else None)(http.post(
                    f"{endpoint}/v1/completions", json={"model": "tiny", "prompt": "def", "max_tokens": 2})), 120)
            assert answer.headers[EXPORT_HEADER] == export_digest(made[1])
        except BaseException:
            print(plane.log() if plane else "")
            raise
        finally:
            if plane is not None:
                plane.stop()
            files.close()
    market.store.dispose()
