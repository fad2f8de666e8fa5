"""Market figures, each printed beside a named peer measured in the same run.

1. Matching decisions per second: 10,000 demands against 1,000 listings with our order book
   (listings indexed by kind and sorted by price, built inside the timed call; capacity tracked as
   leases are made), beside a plain linear scan over every listing applying the same rule (same
   answers, checked). Interleaved repeats.
2. API requests per second with p50 and p99 latency under 32 concurrent clients on loopback, for
   SQLite and PostgreSQL: an authenticated read (GET /v1/funds/balances) and a money-moving write
   (POST /v1/admin/credit, an operator's credit: token check, idempotency key, two-account ledger
   transfer, audit row),
   each beside a bare FastAPI endpoint in the same server doing one indexed read from the same
   store. The three scenarios alternate in rounds (order reversed every other round); a ratio is the
   median of per-round req/s ratios. It shows what our logic costs; the targets are runyard's own
   floors (a read at least half the bare read's rate, a money-moving write at least a fifth).

The server runs in its own process (uvicorn), the clients in this one (asyncio + httpx).

    .venv/bin/python benchmarks/market.py [--seconds 3] [--repeats 3] [--record] [--pg-url postgresql+psycopg://...]
    (PostgreSQL is taken from --pg-url or RUNYARD_TEST_PG_URL; skipped when neither is set)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
from sqlalchemy import create_engine, text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

sys.path.insert(0, str(REPO / "benchmarks"))
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from runyard.market.identity import create_operator  # noqa: E402
from runyard.market.matching import DemandView, ListingView, OrderBook, best_listing  # noqa: E402
from runyard.market.service import Market  # noqa: E402
from runyard.market.signing import generate_keypair  # noqa: E402
from runyard.market.verifiers import AutoApproveVerifier  # noqa: E402
from runyard.system.http_thread import free_port  # noqa: E402

console = Console()
KINDS = ["h100-80gb", "a100-80gb", "l40s", "h200-141gb", "mi300x"]
REGIONS = ["eu-west", "eu-central", "us-east", "us-west", "ap-south"]


# -- 1. matching ---------------------------------------------------------------------------------


def make_book(n_listings: int, n_demands: int, seed: int = 0):
    rng = random.Random(seed)
    now = 1_000_000
    listings = [
        ListingView(
            id=i,
            kind=rng.choice(KINDS),
            price=rng.randint(100, 1000),
            interconnect_rank=rng.randint(0, 2),
            interconnect_gbps=rng.choice([100, 400, 900]),
            region=(r := rng.choice(REGIONS)),
            jurisdiction=r[:2],
            start_class=(sc := rng.choice(["immediate", "queued"])),
            max_queue_s=rng.randint(60, 7200) if sc == "queued" else 0,
            available_from=now - 3600,
            available_until=now + rng.randint(1, 30) * 86400,
        )  # fmt: skip
        for i in range(n_listings)
    ]
    free = {lst.id: rng.choice([8, 16, 64, 256]) for lst in listings}
    demands = [
        DemandView(
            id=i,
            kinds=frozenset(rng.sample(KINDS, rng.randint(1, 2))),
            device_count=rng.choice([1, 2, 4, 8, 16]),
            min_interconnect_rank=rng.randint(0, 2),
            min_interconnect_gbps=rng.choice([0, 100, 400]),
            duration_s=rng.randint(1, 48) * 3600,
            allowed=None if rng.random() < 0.3 else frozenset(rng.sample(REGIONS + ["eu", "us"], 3)),
            latest_start=None if rng.random() < 0.5 else now + rng.randint(0, 7200),
            start_classes=frozenset(rng.sample(["immediate", "queued"], rng.randint(1, 2))),
            max_price=rng.randint(100, 1000),
        )  # fmt: skip
        for i in range(n_demands)
    ]
    return listings, free, demands, now


def bench_matching(n_listings: int, n_demands: int, repeats: int) -> dict:
    listings, free, demands, now = make_book(n_listings, n_demands)
    answers: dict[str, list] = {}

    def ours() -> None:
        book = OrderBook(listings, dict(free))
        answers["ours"] = [book.match(d, now) for d in demands]

    def scan() -> None:
        scan_free = dict(free)
        out = []
        for d in demands:
            found = best_listing(d, listings, scan_free, now)
            if found:
                scan_free[found[0].id] -= d.device_count
            out.append(found)
        answers["peer"] = out

    samples = interleaved({"order book": ours, "linear scan": scan}, repeats, progress=False)
    assert [m and m[0].id for m in answers["ours"]] == [m and m[0].id for m in answers["peer"]], (
        "order book and scan disagree"
    )
    return {"matched": sum(1 for m in answers["ours"] if m), "samples": samples}


# -- 2. HTTP -------------------------------------------------------------------------------------

SERVER = r"""
import sys
sys.path.insert(0, {src!r})
import uvicorn
from fastapi import FastAPI
from sqlalchemy import select
from runyard.market.api import create_app
from runyard.market.verifiers import AutoApproveVerifier
from runyard.market.schema import ledger_accounts
from runyard.market.service import Market
market = Market.open({url!r}, verifier=AutoApproveVerifier(), pool_size=40)
app = create_app(market)
engine = market.store.engine

@app.get("/bench/bare/{{account_id}}")
def bare(account_id: int) -> dict:
    # The peer: one indexed read from the same store, no authentication, no logic.
    with engine.connect() as conn:
        conn = conn.execution_options(runyard_readonly=True)  # a plain BEGIN on SQLite, as our reads use
        row = conn.execute(select(ledger_accounts.c.code, ledger_accounts.c.credits_posted)
                           .where(ledger_accounts.c.id == account_id)).one()
    return {{"code": row.code, "credits": row.credits_posted}}

uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", access_log=False)
"""


def start_server(url: str, port: int) -> subprocess.Popen:
    code = SERVER.format(src=str(REPO / "src"), url=url, port=port)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"benchmark server did not start: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.2)


async def load(base: str, make_request, clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    # One pool of `clients` keep-alive connections, made before the clock starts (creating an httpx
    # client costs milliseconds of CPU, which would otherwise be measured as server latency).
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
        await asyncio.gather(*(http.get("/healthz") for _ in range(clients)))
        stop = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            nonlocal errors
            n = 0
            while time.perf_counter() < stop:
                method, path, kwargs = make_request(i, n)
                t0 = time.perf_counter()
                response = await http.request(method, path, **kwargs)
                latencies.append(time.perf_counter() - t0)
                errors += response.status_code >= 400
                n += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "requests": len(latencies),
        "errors": errors,
    }


def bench_http(url: str, clients: int, seconds: float, repeats: int) -> dict:
    port = free_port()
    proc = start_server(url, port)
    base = f"http://127.0.0.1:{port}"
    try:
        tokens = []
        # Money enters only through a rail or an operator's credit: the write measured is the credit.
        store = Market.open(url, verifier=AutoApproveVerifier())
        ops = {"Authorization": f"Bearer {create_operator(store, 'bench-ops')['token']}"}
        store.store.dispose()
        with httpx.Client(base_url=base) as http:
            for i in range(clients):
                token = http.post("/v1/accounts", json={"name": f"bench-{i}", "role": "tenant",
                                                        "public_key": generate_keypair()[1]}).json()["token"]  # fmt: skip
                auth = {"Authorization": f"Bearer {token}"}
                http.post("/v1/accounts/me/verification", json={}, headers=auth)
                tokens.append(auth)
        run = uuid.uuid4().hex[:8]
        scenarios = {
            "bare indexed read (peer)": lambda i, n: ("GET", f"/bench/bare/{4 + i}", {}),
            "GET /v1/funds/balances": lambda i, n: ("GET", "/v1/funds/balances", {"headers": tokens[i]}),
            "POST /v1/admin/credit": lambda i, n: (
                "POST",
                "/v1/admin/credit",
                {"json": {"account": f"bench-{i}", "amount": 1, "reason": "bench"},
                 "headers": {**ops, "Idempotency-Key": f"{run}-{i}-{n}"}},
            ),  # fmt: skip
        }
        rounds: dict[str, list[dict]] = {name: [] for name in scenarios}
        for make in scenarios.values():
            asyncio.run(load(base, make, clients, 0.5))  # warm-up: connections, pools, caches
        names = list(scenarios)
        for r in range(repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                rounds[name].append(asyncio.run(load(base, scenarios[name], clients, seconds)))
        return rounds
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def pg_schema_url(base_url: str) -> tuple[str, object]:
    engine = create_engine(base_url, isolation_level="AUTOCOMMIT")
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    with engine.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))

    def drop() -> None:
        with engine.connect() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()

    sep = "&" if "?" in base_url else "?"
    return f"{base_url}{sep}options={quote(f'-csearch_path={schema}')}", drop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--listings", type=int, default=1000)
    parser.add_argument("--demands", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per HTTP scenario per round")
    parser.add_argument("--pg-url", default=os.environ.get("RUNYARD_TEST_PG_URL"))
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)
    report = Report("market", args, packages=["fastapi", "uvicorn", "sqlalchemy", "psycopg"])

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("matching", total=None)
        m = bench_matching(args.listings, args.demands, args.repeats)
        progress.update(task, description="done")
    ours, peer = m["samples"]["order book"], m["samples"]["linear scan"]
    console.print(
        f"[bold]matching[/] {args.demands} demands x {args.listings} listings ({m['matched']} matched): "
        f"order book {ours.rate(args.demands).spread()} decisions/s, linear scan (peer) "
        f"{peer.rate(args.demands).spread()}/s"
    )
    report.ratio("matching_vs_linear_scan", paired_ratio(peer, ours), "linear scan over every listing, same rule",
                 ">=", 1.0)

    backends = [("sqlite", str(Path(tempfile.mkdtemp()) / "bench.db"), None)]
    if args.pg_url:
        url, drop = pg_schema_url(args.pg_url)
        backends.append(("postgresql", url, drop))
    else:
        report.note("PostgreSQL skipped: set --pg-url or RUNYARD_TEST_PG_URL")
    for name, url, drop in backends:
        try:
            with console.status(f"HTTP load on {name} ({args.clients} clients, {args.repeats} rounds)"):
                result = bench_http(url, args.clients, args.seconds, args.repeats)
        finally:
            if drop:
                drop()
        table = Table(title=f"{name}: {args.clients} concurrent clients on loopback, "
                            f"{args.seconds:g} s x {args.repeats} rounds each (median round)")
        for column in ("endpoint", "req/s [min..max]", "p50 ms", "p99 ms", "errors"):
            table.add_column(column, justify="right" if column != "endpoint" else "left")
        rps = {endpoint: Samples([r["rps"] for r in rounds]) for endpoint, rounds in result.items()}
        for endpoint, rounds in result.items():
            table.add_row(endpoint, f"{rps[endpoint].median:,.0f} [{rps[endpoint].low:,.0f}..{rps[endpoint].high:,.0f}]",
                          f"{Samples([r['p50_ms'] for r in rounds]).median:.1f}",
                          f"{Samples([r['p99_ms'] for r in rounds]).median:.1f}",
                          str(sum(r["errors"] for r in rounds)))  # fmt: skip
        console.print(table)
        bare = rps["bare indexed read (peer)"]
        for endpoint, key, target in [("GET /v1/funds/balances", "balances_read", 0.5),
                                      ("POST /v1/admin/credit", "credit_write", 0.2)]:
            report.ratio(f"http_{name}_{key}_vs_bare_read", paired_ratio(rps[endpoint], bare),
                         f"bare FastAPI indexed read, same server, {name}", ">=", target,
                         {"rps": rps[endpoint].values, "bare_rps": bare.values})
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())
