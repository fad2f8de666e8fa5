"""`runyard maintain LEASE_ID`: keep a model served on a standing lease fit, from the tenant's
side (runyard.maintain.upkeep): drift on its traffic buys one retraining per episode on the market,
within a budget, and a retrained model fit to ship is rolled out on the same lease.

It runs until interrupted (Ctrl-C, SIGTERM), one round every --poll-s, keeping its state in
--state-dir, so a maintainer stopped and started again goes on where it was. A verb of its own, not
one of `runyard market`'s: it needs the serving side's retrainer (numpy, the request log), which a
market host does not install.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

from runyard.cli.market_common import DEFAULT_IDENTITY, DEFAULT_URL, client_for
from runyard.cli.readers import export_dir_of
from runyard.errors import RunyardError
from runyard.maintain.endpoint_client import EndpointClient
from runyard.maintain.upkeep import Maintainer, Policy
from runyard.serve.retrain import DEFAULT_MIN_LOGGED
from runyard.serve.retrain_market import DEFAULT_DEADLINE_S


def register(verbs: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    p = verbs.add_parser(
        "maintain", help="keep a model served on a standing lease fit: drift buys its retraining, the retrained model is rolled out",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("lease_id", type=int, help="the running standing lease that serves the model")
    p.add_argument("--token-file", type=Path, required=True,
                   help="the endpoint token file written when the deployment was placed (`demand --token-file`)")
    p.add_argument("--retrain-spec", type=Path, required=True,
                   help="the spec a retraining runs (usually the one the served model was trained with); the "
                   "logged traffic is added to its data and model.init points at the served export")
    p.add_argument("--export", type=Path, required=True,
                   help="the export the lease serves now (a run directory or its export/): the first retraining "
                   "starts from it; later ones from each export rolled out")
    p.add_argument("--budget", type=int, required=True, metavar="MINOR_UNITS",
                   help="the most retraining escrow to commit per budget period (minor units)")
    p.add_argument("--budget-period-s", type=int, default=86_400, metavar="S", help="the budget's period (default a day)")
    p.add_argument("--max-price", type=int, default=None, metavar="MINOR_UNITS",
                   help="the most to pay per device-hour (default: what the whole budget pays for the requirement)")
    p.add_argument("--deadline-s", type=int, default=DEFAULT_DEADLINE_S, metavar="S",
                   help="a retraining demand must start within S seconds, else it expires and its escrow returns "
                   "(default %(default)s)")
    p.add_argument("--min-logged", type=int, default=DEFAULT_MIN_LOGGED, metavar="N",
                   help="place no retraining that would learn from fewer than N logged records (default %(default)s)")
    p.add_argument("--publish", nargs=2, default=None, metavar=("DIR", "URL"),
                   help="DIR's files are published at URL (an object store, a file server the provider reaches): "
                   "exports under DIR go to the provider as URLs instead of uploads, which are limited to 256 KiB")
    p.add_argument("--without-env-lock", action="store_true",
                   help="run retraining in the provider's environment rather than rebuilding the served model's "
                   "run's environment from its lock (faster; the retrained model's versions may differ)")
    p.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="where the upkeep keeps its state, the mirrored traffic and the delivered results "
                   "(default ./maintain-lease-LEASE_ID)")
    p.add_argument("--poll-s", type=float, default=5.0, metavar="S", help="seconds between rounds (default 5)")
    p.add_argument("--identity", default=DEFAULT_IDENTITY,
                   help="the tenant's identity file (env RUNYARD_MARKET_IDENTITY; default %(default)s)")
    p.add_argument("--url", default=DEFAULT_URL, help="market URL (default: the one in the identity)")
    p.set_defaults(handler=run, needs_identity=True)


def run(args: argparse.Namespace) -> int:
    if args.poll_s <= 0:
        raise RunyardError(f"--poll-s must be positive, got {args.poll_s}")
    try:
        token = args.token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise RunyardError(f"--token-file {args.token_file}: {exc}") from None
    export = export_dir_of(args.export)
    root, url = (Path(args.publish[0]), args.publish[1]) if args.publish else (None, None)
    policy = Policy(args.lease_id, args.retrain_spec, args.budget, args.budget_period_s, args.max_price,
                    args.deadline_s, args.min_logged, root, url, env_lock=not args.without_env_lock)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with client_for(args) as client:
        lease = client.lease(args.lease_id)
        if lease["form"] != "standing" or not lease.get("endpoint_url"):
            raise RunyardError(f"lease {args.lease_id} is not a standing lease serving an endpoint "
                               f"(form {lease['form']}, state {lease['state']})")
        endpoint = EndpointClient(lease["endpoint_url"], token)
        try:
            upkeep = Maintainer(policy, args.state_dir or Path(f"maintain-lease-{args.lease_id}"), client, endpoint,
                                export)
            upkeep.retrainer()  # the spec, budget and price checked now, not at the first drift (exit 2)
            while not stop.is_set():
                upkeep.step()
                stop.wait(args.poll_s)
        finally:
            endpoint.close()
    return 0
