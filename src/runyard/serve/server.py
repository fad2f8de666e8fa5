"""`runyard serve`: load an export, build the engine and everything around it, serve until stopped.

The engine is runyard's own (`BatchEngine`: continuous batching on CPU or GPU, stepping in a process of
its own, serve/engine_process.py, unless `engine_process=False`) or, with
`engine="vllm"`, vLLM over the same export directory (a GPU and the `vllm` package needed); either
way the routes, the metrics and the drift watch are the same (serve/openai_api.py).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI

from runyard.data.chat import load_chat_template
from runyard.errors import RunyardError
from runyard.market.client import MarketClient
from runyard.model.hf.export import ExportError, read_export_config
from runyard.serve.batch_engine import DEFAULT_KV_CACHE_BYTES
from runyard.serve.chat import chat_prompt
from runyard.serve.drift import DEFAULT_FALSE_ALARM_RATE, DriftMonitor, DriftReference
from runyard.serve.engine_core import CoreOptions, build_batch_engine
from runyard.serve.engine_process import EngineProcess
from runyard.serve.errors import ServeConfigError
from runyard.serve.openai_api import DEFAULT_MAX_BODY_BYTES, create_app
from runyard.serve.request_log import RequestLog
from runyard.serve.retrain import DEFAULT_MIN_LOGGED, Retrainer, read_spec_mapping
from runyard.serve.retrain_budget import BUDGET_FILE, DEFAULT_BUDGET_PERIOD_S, MaintenanceBudget
from runyard.serve.retrain_market import DEFAULT_DEADLINE_S, MarketRetrainer
from runyard.serve.traffic_share import add_traffic_routes
from runyard.serve.vllm_engine import VllmEngine
from runyard.serve.watch import TrafficWatch

log = logging.getLogger("runyard.serve")
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    engine: str = "runyard"  # or "vllm"
    model_name: str | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_batch: int = 64
    max_queue: int = 256
    max_prefill_tokens: int = 4096
    compile: bool = False
    # runyard's engine steps in a process of its own (serve/engine_core.py); False: on a thread of the server's
    engine_process: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_requests: Path | None = None
    share_traffic: bool = False  # GET /v1/traffic hands the sealed log back (serve/traffic_share.py)
    retrain_spec: Path | None = None
    control_url: str | None = None
    drift_check_every: int = 5
    drift_sustain_requests: int = 20
    drift_false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE
    drift_warmup: int = 50
    retrain_min_logged: int = DEFAULT_MIN_LOGGED
    tensor_parallel_size: int = 1
    # Retraining through the market (serve/retrain_market.py) instead of a local control plane.
    retrain_via: str = "control"  # or "market"
    market_url: str | None = None
    identity: Path | None = None  # the tenant's market identity file
    budget: int | None = None  # minor units of retraining escrow per budget period
    budget_period_s: int = DEFAULT_BUDGET_PERIOD_S
    max_price: int | None = None  # per device-hour; None: the most the budget pays for the requirement
    retrain_deadline_s: int = DEFAULT_DEADLINE_S
    retrain_results_to: str | None = None
    retrain_export_url: str | None = None


# What only `--retrain-via market` acts on: ServeOptions field -> its flag.
MARKET_ONLY = {"market_url": "--market", "identity": "--identity", "budget": "--budget", "max_price": "--max-price",
               "retrain_results_to": "--retrain-results-to", "retrain_export_url": "--retrain-export-url"}
MARKET_CLIENT_TIMEOUT_S = 15.0  # a drift event's placement waits at most this for the market per attempt


def model_name_for(export_dir: Path) -> str:
    """The name an export is served under: its run's name, else its parent directory's."""
    try:
        name = read_export_config(export_dir).get("extra", {}).get("run_name")
    except ExportError:
        name = None
    return str(name or Path(export_dir).resolve().parent.name)


def check_options(export_dir: Path, options: ServeOptions) -> None:
    """Refuse contradictory options before anything is loaded."""
    if options.engine not in ("runyard", "vllm"):
        raise ServeConfigError(f"unknown engine {options.engine!r}: expected 'runyard' or 'vllm'")
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise ServeConfigError(f"--device {options.device}: no CUDA device is available")
    if options.retrain_via not in ("control", "market"):
        raise ServeConfigError(f"--retrain-via {options.retrain_via!r}: expected 'control' or 'market'")
    if options.retrain_via == "control":
        given = [flag for name, flag in MARKET_ONLY.items() if getattr(options, name) is not None]
        if given:
            raise ServeConfigError(f"{', '.join(given)} belong(s) to --retrain-via market (retraining through the "
                                   "market); without it a retraining goes to a control plane (--control)")
        if (options.retrain_spec is None) != (options.control_url is None):
            raise ServeConfigError("--retrain-spec and --control go together: the spec to retrain and where to submit it")
    else:
        check_market_options(options)
    if options.retrain_spec is not None and options.log_requests is None:
        raise ServeConfigError("--retrain-spec needs --log-requests DIR: the retraining data includes the logged traffic")
    if options.retrain_spec is not None and DriftReference.load(export_dir) is None:
        raise ServeConfigError(f"{export_dir} has no drift reference, so drift cannot trigger retraining")
    if options.drift_sustain_requests < 0 or options.drift_check_every < 1:
        raise ServeConfigError("--drift-sustain must be >= 0 and --drift-check-every >= 1")
    if not 0 < options.drift_false_alarm_rate < 0.5:
        raise ServeConfigError(f"--drift-false-alarm-rate must be in (0, 0.5), got {options.drift_false_alarm_rate}")
    if options.drift_warmup < 0:
        raise ServeConfigError(f"--drift-warmup must be >= 0, got {options.drift_warmup}")
    if options.retrain_min_logged < 0:
        raise ServeConfigError(f"--retrain-min-logged must be >= 0, got {options.retrain_min_logged}")


def check_market_options(options: ServeOptions) -> None:
    """`--retrain-via market` needs the spec, the market, the tenant's identity and a budget, and no
    control plane."""
    if options.control_url is not None:
        raise ServeConfigError("--control is where --retrain-via control submits; --retrain-via market places a "
                               "demand on --market instead: give one of them")
    missing = [flag for flag, value in (("--retrain-spec", options.retrain_spec), ("--market", options.market_url),
                                        ("--identity", options.identity), ("--budget", options.budget)) if value is None]
    if missing:
        raise ServeConfigError(f"--retrain-via market needs {', '.join(missing)}: the spec to retrain, the market, "
                               "the tenant's identity file and the maintenance budget (minor units per period)")
    if options.budget < 1 or options.budget_period_s < 1:
        raise ServeConfigError("--budget and --budget-period-s must be at least 1")
    if options.max_price is not None and options.max_price < 1:
        raise ServeConfigError(f"--max-price must be at least 1 minor unit per device-hour, got {options.max_price}")
    if options.retrain_deadline_s < 1:
        raise ServeConfigError(f"--retrain-deadline-s must be at least 1, got {options.retrain_deadline_s}")


def market_retrainer(export_dir: Path, options: ServeOptions, request_log: RequestLog) -> MarketRetrainer:
    """The retrainer of `--retrain-via market`: the tenant's client, the budget kept beside the request log."""
    try:
        client = MarketClient.from_identity_file(options.identity, base_url=options.market_url,
                                                 timeout=MARKET_CLIENT_TIMEOUT_S, retries=1)
    except RunyardError as exc:
        raise ServeConfigError(f"--identity {options.identity}: {exc}") from None
    budget = MaintenanceBudget(request_log.directory.parent / BUDGET_FILE, options.budget, options.budget_period_s)
    return MarketRetrainer(options.retrain_spec, export_dir, request_log, client, budget,
                           max_price=options.max_price, deadline_s=options.retrain_deadline_s,
                           results_to=options.retrain_results_to, export_url=options.retrain_export_url,
                           min_logged=options.retrain_min_logged)


def build_engine(export_dir: Path, options: ServeOptions):
    """The engine for `options.engine` over `export_dir`."""
    if options.engine == "vllm":
        return VllmEngine(export_dir, tensor_parallel_size=options.tensor_parallel_size, max_queue=options.max_queue)
    core = CoreOptions(device=options.device, kv_cache_bytes=options.kv_cache_bytes, max_batch=options.max_batch,
                       max_prefill_tokens=options.max_prefill_tokens, compile=options.compile)
    if options.engine_process:
        return EngineProcess(export_dir, core, max_queue=options.max_queue)
    return build_batch_engine(export_dir, core, max_queue=options.max_queue).start()


CHAT_MARK = "\u2063runyard-turn\u2063"  # stands for a user turn's text when the template's framing is measured


def chat_framing(export_dir: Path, encode) -> tuple[list[int], list[int]] | None:
    """The token ids a chat template puts before and after a one-turn conversation's text, which drift's
    null keeps verbatim around its excerpts (a chat request is a turn, not a document); None without a
    template or when the framing does not tokenize apart from the text."""
    template = load_chat_template(export_dir)
    if template is None:
        return None
    try:
        text = chat_prompt(template, [{"role": "user", "content": CHAT_MARK}])
    except Exception:  # a template that refuses a bare user turn: judge chat prompts unframed
        return None
    if text.count(CHAT_MARK) != 1:
        return None
    before, after = text.split(CHAT_MARK)
    return (list(encode(before)) if before else []), (list(encode(after)) if after else [])


def build_watch(export_dir: Path, options: ServeOptions, engine=None) -> TrafficWatch | None:
    """Drift monitoring (when the export has a drift reference), request logging and retraining, as
    the options ask. `engine` (its tokenizer) lets the monitor decode what moved and see chat framing."""
    reference = DriftReference.load(export_dir)
    monitor = None
    if reference is not None:
        tokenizer = getattr(engine, "tokenizer", None)
        monitor = DriftMonitor(
            reference, false_alarm_rate=options.drift_false_alarm_rate, warmup=options.drift_warmup,
            framing=chat_framing(export_dir, engine.encode) if engine is not None else None,
            decode=tokenizer.decode if tokenizer is not None else None,
        )
    request_log = RequestLog(options.log_requests) if options.log_requests is not None else None
    retrainer = None
    if options.retrain_spec is not None and options.retrain_via == "market":
        retrainer = market_retrainer(export_dir, options, request_log)
    elif options.retrain_spec is not None:
        retrainer = Retrainer(options.retrain_spec, options.control_url, export_dir, request_log,
                              min_logged=options.retrain_min_logged)
    if monitor is None and request_log is None:
        return None
    return TrafficWatch(
        monitor, request_log, retrainer,
        check_every=options.drift_check_every, sustain_requests=options.drift_sustain_requests,
        # Through the market the maintenance budget caps retraining, one per drift episode.
        max_retrains=None if options.retrain_via == "market" else 1,
    )


def build_app(export_dir: Path, options: ServeOptions) -> tuple[FastAPI, list]:
    """The app for an export, and the things to close when it stops (engine, watch)."""
    export_dir = Path(export_dir)
    check_options(export_dir, options)
    if options.share_traffic and options.log_requests is None:
        raise ServeConfigError("--share-traffic hands back the logged traffic: it needs --log-requests DIR")
    if options.retrain_spec is not None:
        read_spec_mapping(options.retrain_spec)  # a bad spec is refused now, not at the first drift event
    engine = build_engine(export_dir, options)
    closers = [engine]
    try:
        watch = build_watch(export_dir, options, engine)
        if watch is not None:
            closers.append(watch)
        app = create_app(
            engine,
            options.model_name or model_name_for(export_dir),
            chat_template=load_chat_template(export_dir),
            traffic=watch,
            max_body_bytes=options.max_body_bytes,
            on_shutdown=[thing.close for thing in reversed(closers)],
        )
        if options.share_traffic and watch is not None and watch.request_log is not None:
            add_traffic_routes(app, watch.request_log)
    except BaseException:
        for thing in closers:
            thing.close()
        raise
    return app, closers


def serve_export(export_dir: Path, options: ServeOptions | None = None) -> None:
    """Load an export and serve it until interrupted."""
    options = options or ServeOptions()
    # The thread that brings the engine's events (the engine itself, in-process) and the event loop hand the
    # GIL to each other at every step; Python's default 5 ms switch interval would add up to that to each.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app, closers = build_app(export_dir, options)  # the app's shutdown closes them
    try:
        # No access log: a line per request costs more than a small model's token, and the metrics count them.
        uvicorn.run(app, host=options.host, port=options.port, log_level="info", access_log=False)
    except BaseException:
        for thing in reversed(closers):  # uvicorn never started (port taken...): close them here
            thing.close()
        raise
