"""Many clients at once against one server, on SQLite and PostgreSQL: deposits, demands, lease
starts, usage reports, acknowledgements and settlements, with every money-moving request sent twice
at the same moment under the same idempotency key. Afterwards the audit passes, and every request
was applied exactly once."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from runyard.market.client import MarketClient
from runyard.market.server import ServerThread

from .helpers import (
    HOUR,
    RAIL,
    assert_audit_ok,
    listing,
    new_party,
    open_market,
    operator_client,
    requirement,
)

TENANTS = 4
DEPOSITS = 3
DEMANDS = 2
THREADS = 16


def run_twice_concurrently(tasks, threads=THREADS):
    """Run every task twice, shuffled, on a thread pool; return {task id: [result, result]}."""
    jobs = [t for t in tasks for _ in range(2)]
    random.Random(7).shuffle(jobs)
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda job: (job[0], job[1]()), jobs))
    out: dict = {}
    for task_id, result in results:
        out.setdefault(task_id, []).append(result)
    return out


@pytest.mark.slow
def test_concurrent_clients_apply_each_request_once(store_url):
    market = open_market(store_url, fee_bps=100)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "big-farm", "provider", ops)
        provider.client.create_listing(
            **listing(devices_per_node=8, node_count=100, price_per_device_hour=360)
        )
        tenants = [new_party(server.url, f"tenant-{i}", "tenant", ops) for i in range(TENANTS)]

        # One client per (thread, party): an httpx client is not shared across threads.
        local = threading.local()

        def client_of(party):
            cache = local.__dict__.setdefault("clients", {})
            if party.name not in cache:
                cache[party.name] = MarketClient(
                    server.url, token=party.client.token, private_key=party.client.private_key
                )
            return cache[party.name]

        # Each rail event delivered twice at the same moment: applied once, the other answer a duplicate.
        deposits = [
            ((t.name, i), lambda t=t, i=i: client_of(t).rail_deposit(RAIL, t.id, 1000 * (i + 1), f"evt-{t.name}-{i}"))
            for t in tenants for i in range(DEPOSITS)
        ]  # fmt: skip
        done = run_twice_concurrently(deposits)
        for (name, i), (a, b) in done.items():
            assert a["transfer_id"] == b["transfer_id"], f"deposit {name}/{i} applied twice"
            assert sorted([a["duplicate"], b["duplicate"]]) == [False, True]
        expected_deposit = sum(1000 * (i + 1) for i in range(DEPOSITS))

        demands = [
            ((t.name, i), lambda t=t, i=i: client_of(t).place_demand(requirement(device_count=2, duration_s=HOUR), 400, f"dem-{i}"))
            for t in tenants for i in range(DEMANDS)
        ]  # fmt: skip
        placed = run_twice_concurrently(demands)
        for key, (a, b) in placed.items():
            assert a["id"] == b["id"] and a["state"] == "matched", key
        lease_ids = sorted(a["lease_id"] for a, _ in placed.values())
        assert len(set(lease_ids)) == TENANTS * DEMANDS

        starts = [
            (lid, lambda lid=lid: (client_of(provider).accept_lease(lid, f"acc-{lid}"),
                                   client_of(provider).start_lease(lid, f"start-{lid}"))[1])
            for lid in lease_ids
        ]  # fmt: skip
        started = {lid: a["started_at"] for lid, (a, b) in run_twice_concurrently(starts).items()}

        ops.advance_clock(HOUR)
        reports = [
            ((lid, seq), lambda lid=lid, seq=seq: client_of(provider).report_usage(
                lid, seq, started[lid] + (seq - 1) * 1800, started[lid] + seq * 1800, 2 * 1800, idempotency_key=f"use-{lid}-{seq}"))
            for lid in lease_ids for seq in (1,)
        ]  # fmt: skip
        reported = run_twice_concurrently(reports)
        for a, b in reported.values():
            assert a["id"] == b["id"]
        # Second records and acknowledgements of the first, all at once.
        owner = {
            a["lease_id"]: tenants[[t.name for t in tenants].index(k[0])] for k, (a, _) in placed.items()
        }
        mixed = [
            (("use2", lid), lambda lid=lid: client_of(provider).report_usage(
                lid, 2, started[lid] + 1800, started[lid] + 3600, 1800, idempotency_key=f"use-{lid}-2"))
            for lid in lease_ids
        ] + [
            (("ack", lid), lambda lid=lid: client_of(owner[lid]).acknowledge(reported[(lid, 1)][0]["id"], idempotency_key=f"ack-{lid}"))
            for lid in lease_ids
        ]  # fmt: skip
        run_twice_concurrently(mixed)

        ops.advance_clock(HOUR)  # past the window and the dispute window
        settles = [
            (("t", lid), lambda lid=lid: client_of(owner[lid]).settle(lid, f"settle-{lid}")) for lid in lease_ids
        ] + [(("p", lid), lambda lid=lid: client_of(provider).settle(lid, f"psettle-{lid}")) for lid in lease_ids] + [
            (("sweep", 0), lambda: MarketClient(server.url, token=ops.token).sweep())
        ]  # fmt: skip
        run_twice_concurrently(settles)
        ops.sweep()

        # Each lease: 2 devices x (1800 + 900) device-seconds... = 5400 device-seconds at 360/h = 540; fee 1%.
        for lid in lease_ids:
            lease = ops.request("GET", f"/v1/leases/{lid}")
            assert lease["state"] == "settled", lease
            assert (lease["paid_provider"], lease["paid_fee"], lease["refunded"]) == (535, 5, 720 - 540)
        for t in tenants:
            totals = client_of(t).statement()["totals"]
            assert totals["reconciles"]
            assert totals["deposited"] == expected_deposit
            assert totals["charged"] == DEMANDS * 540
        assert client_of(provider).statement()["totals"]["earned"] == len(lease_ids) * 535
        assert ops.audit()["ok"]
    assert_audit_ok(market)
    market.store.dispose()
