"""The `serve` verb: serve a run's exported model over OpenAI's API."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from runyard.cli.readers import say_if_live
from runyard.cli.run_progress import finished_export
from runyard.serve.drift import DEFAULT_FALSE_ALARM_RATE
from runyard.serve.errors import ServeConfigError
from runyard.serve.predict import serve_predictor
from runyard.serve.predict_export import is_predict_export
from runyard.serve.request_log import NO_LABELS
from runyard.serve.retrain import DEFAULT_MIN_LOGGED
from runyard.serve.retrain_budget import DEFAULT_BUDGET_PERIOD_S
from runyard.serve.retrain_market import DEFAULT_DEADLINE_S
from runyard.serve.server import ServeOptions, serve_export

DESCRIPTION = """\
Serve RUN_DIR/export to many clients at once: OpenAI's POST /v1/completions and
/v1/chat/completions (streaming with "stream": true; the chat template comes from the export's
tokenizer_config.json), GET /v1/models, /healthz, /metrics (Prometheus) and /v1/drift.

Requests are batched continuously within a fixed KV cache budget; past --max-queue waiting sequences
a request gets 429 with Retry-After. Live prompts are compared with the training distribution; with
--log-requests they are also kept (PII-scrubbed) as a JSONL dataset, and with --retrain-spec and
--control a sustained drift submits one retraining job, whose data includes that traffic, to the
control plane; with --retrain-via market it places one funded demand on a market instead, within a
maintenance --budget. --engine vllm hands the export to vLLM instead (a GPU and a Hugging Face export needed).

A table or image model's export is served at POST /v1/predict instead ({"rows": [...]} or
{"images": [...]}, validated against its feature schema: a missing or mistyped feature is a 422 naming
it), with GET /v1/schema, /v1/drift (PSI per numeric feature, JS divergence per categorical one),
/v1/models, /healthz and /metrics. Drift is judged at --drift-false-alarm-rate for every family.
--log-requests keeps its rows (JSONL with the feature schema) or images (.npz) in DIR, bounded. The
language-model-only options (--retrain-spec, --control, --retrain-min-logged, --drift-sustain,
--drift-check-every, --drift-warmup, --engine vllm, the batching options) are refused for a table or
image export (exit 2 naming the option), not ignored: logged rows and images carry no labels, so
there is nothing to retrain a supervised model on.
"""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0 < value < 0.5:
        raise argparse.ArgumentTypeError(f"must be a rate in (0, 0.5), got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {value}")
    return value


def register(verbs: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    p = verbs.add_parser(
        "serve",
        help="serve a run's exported model over an OpenAI-compatible HTTP API",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path, help="run directory (or its export/ directory)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="port (default %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu; bf16 on cuda)")
    p.add_argument("--engine", choices=["runyard", "vllm"], default="runyard", help="serving engine (default runyard)")
    p.add_argument("--model-name", default=None, help="name clients use for the model (default: the run's name)")
    g = p.add_argument_group("batching and memory")
    g.add_argument("--kv-cache-mb", type=_positive, default=512, help="KV cache budget in MiB (default 512)")
    g.add_argument("--max-batch", type=_positive, default=64, help="most sequences decoded together (default 64)")
    g.add_argument("--max-queue", type=_positive, default=256, help="waiting sequences before 429 (default 256)")
    g.add_argument("--max-prefill-tokens", type=_positive, default=4096,
                   help="prompt tokens prefilled in one step; a longer prompt is prefilled in chunks over several "
                   "steps (default 4096)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile: on CPU, the decode-only steps (two graphs: one sequence, several), "
                        "compiled with the weights packed (a copy per graph in memory; needs a C++ compiler) "
                        "before the server listens; on a GPU, the whole model, compiled as the first requests arrive")
    g.add_argument("--engine-in-process", action="store_true",
                   help="step runyard's engine on a thread of the server's process instead of a process of its own "
                        "(the default, where the steps do not share Python's interpreter lock with the HTTP work)")
    g.add_argument("--tensor-parallel-size", type=_positive, default=1, help="GPUs per model with --engine vllm")
    d = p.add_argument_group("traffic, drift and retraining")
    d.add_argument("--log-requests", type=Path, default=None, metavar="DIR",
                   help="keep every prompt, PII-scrubbed, as JSONL segments in DIR (a data-stage source); a table or "
                   "image server keeps its rows or images there")
    d.add_argument("--share-traffic", action="store_true",
                   help="answer GET /v1/traffic (the sealed log's segments) and GET /v1/traffic/NAME (one segment), "
                   "so whoever runs a model on another machine (a standing lease's tenant) can retrain on its "
                   "traffic; off by default: on a server anyone can reach, the log would be everyone's")
    d.add_argument("--drift-sustain", type=int, default=20, metavar="N",
                   help="drift must stay past its threshold for N requests to be an event (default 20)")
    d.add_argument("--drift-check-every", type=_positive, default=5, metavar="N",
                   help="judge drift every N requests (default 5)")
    d.add_argument("--drift-false-alarm-rate", type=_rate, default=DEFAULT_FALSE_ALARM_RATE, metavar="RATE",
                   help="share of drift judgements that may alarm on in-distribution traffic (default 0.01: 1%% "
                   "per judgement; thresholds are set from the null at this rate, corrected for every window, "
                   "statistic and feature judged together)")
    d.add_argument("--drift-warmup", type=int, default=50, metavar="N",
                   help="judge no drift before N requests (default 50; a smoke test is not judged)")
    d.add_argument("--retrain-spec", type=Path, default=None, metavar="SPEC",
                   help="on a drift event, submit SPEC plus the logged traffic as a retraining job")
    d.add_argument("--retrain-min-logged", type=int, default=DEFAULT_MIN_LOGGED, metavar="N",
                   help="submit no retraining whose data would hold fewer than N logged records after the traffic "
                   "filters and exact-repeat removal (default %(default)s); the drift event records why")
    d.add_argument("--control", default=None, metavar="STATE_DIR|URL",
                   help="the control plane to submit retraining to: its state directory (address and API token "
                   "are read there), or its URL with the token in $RUNYARD_CONTROL_TOKEN")
    m = p.add_argument_group(
        "retraining through the market (--retrain-via market)",
        "On a drift event, place one funded block demand on a market instead of submitting to a control plane: "
        "the retraining spec with the newest logged traffic uploaded as its data, model.init from the served "
        "export (carried with the demand), the run's environment lock when RUN/env has one, the spec's "
        "resources.requirement, a maximum price and a deadline to start by. One drift episode places at most one "
        "demand; a market that cannot be reached is tried again with backoff, each attempt recorded on the event "
        "in /v1/drift. The job is checked at start as the market and a provider would check it (exit 2 naming "
        "the field).")
    m.add_argument("--retrain-via", choices=["control", "market"], default="control",
                   help="where a retraining goes: a local control plane (--control, the default) or the market")
    m.add_argument("--market", default=None, metavar="URL", help="the market to place retraining demands on")
    m.add_argument("--identity", type=Path, default=None, metavar="FILE",
                   help="the tenant's market identity file (`runyard market register` writes it); the demand's "
                   "escrow comes from this account")
    m.add_argument("--budget", type=int, default=None, metavar="N",
                   help="maintenance budget: the most retraining may commit per period, in minor units of the "
                   "market's currency. A demand's escrow (max price x devices x duration) counts against it when "
                   "it is decided; one past the budget is not placed and its event says why. Kept in "
                   "retrain-budget.json beside the request log, so a restart does not reset it")
    m.add_argument("--budget-period-s", type=int, default=DEFAULT_BUDGET_PERIOD_S, metavar="S",
                   help="the budget's period in seconds, counted from the Unix epoch (default %(default)s: 30 days)")
    m.add_argument("--max-price", type=int, default=None, metavar="P",
                   help="the most a retraining pays per device-hour, minor units (default: the most the whole "
                   "budget pays for the spec's requirement)")
    m.add_argument("--retrain-deadline-s", type=int, default=DEFAULT_DEADLINE_S, metavar="S",
                   help="the demand must start within S seconds of the event (its latest_start, default "
                   "%(default)s); with no capacity by then it expires and its escrow returns, and an unreachable "
                   "market is not tried past it")
    m.add_argument("--retrain-results-to", default=None, metavar="PATH|URL",
                   help="where providers deliver retrainings, each under its own name (default: retrain-results/ "
                   "beside the request log, for a provider sharing this filesystem)")
    m.add_argument("--retrain-export-url", default=None, metavar="BASE",
                   help="the served export's files at BASE/NAME over http(s): the provider fetches them instead of "
                   "their being uploaded with the demand (needed past 256 KiB, e.g. any trained model with its "
                   "drift sample)")
    p.set_defaults(handler=cmd_serve, language_only_defaults={name: p.get_default(name) for name in LANGUAGE_ONLY})


# Options only a language-model server acts on: given to a table or image server with a value other
# than their default they are an error, not silently dropped.
LANGUAGE_ONLY = ("retrain_spec", "retrain_min_logged", "control", "retrain_via", "market", "identity", "budget",
                 "budget_period_s", "max_price", "retrain_deadline_s", "retrain_results_to", "retrain_export_url",
                 "drift_sustain", "drift_check_every", "drift_warmup",
                 "engine", "kv_cache_mb", "max_batch", "max_queue", "max_prefill_tokens", "compile",
                 "engine_in_process", "tensor_parallel_size", "share_traffic")


def _language_only_options(args: argparse.Namespace) -> list[str]:
    """The language-model-only options set on this command line, as flags."""
    defaults = args.language_only_defaults
    return ["--" + name.replace("_", "-") for name in LANGUAGE_ONLY if getattr(args, name) != defaults[name]]


def cmd_serve(args: argparse.Namespace) -> int:
    say_if_live(args.run_dir)
    export_dir = finished_export(args.run_dir)
    if is_predict_export(export_dir):  # a table or image model: POST /v1/predict (serve/predict.py)
        refused = _language_only_options(args)
        if refused:
            why = ("language-model options: a predict server has no retraining or batching"
                   + (f"; {NO_LABELS}" if args.retrain_spec is not None else ""))
            raise ServeConfigError(f"{export_dir} is a table or image model, which cannot act on {', '.join(refused)} "
                                   f"({why})")
        serve_predictor(export_dir, host=args.host, port=args.port, model_name=args.model_name, device=args.device,
                        false_alarm_rate=args.drift_false_alarm_rate, log_requests=args.log_requests)
        return 0
    if args.retrain_via != "market":
        given = [flag for flag, value, default in (("--budget-period-s", args.budget_period_s, DEFAULT_BUDGET_PERIOD_S),
                                                   ("--retrain-deadline-s", args.retrain_deadline_s, DEFAULT_DEADLINE_S))
                 if value != default]
        if given:
            raise ServeConfigError(f"{', '.join(given)} belong(s) to --retrain-via market (retraining through the market)")
    serve_export(
        export_dir,
        ServeOptions(
            host=args.host,
            port=args.port,
            device=args.device,
            engine=args.engine,
            model_name=args.model_name,
            kv_cache_bytes=args.kv_cache_mb * 1024 * 1024,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            max_prefill_tokens=args.max_prefill_tokens,
            compile=args.compile,
            engine_process=not args.engine_in_process,
            log_requests=args.log_requests,
            share_traffic=args.share_traffic,
            retrain_spec=args.retrain_spec,
            control_url=args.control,
            drift_check_every=args.drift_check_every,
            drift_sustain_requests=args.drift_sustain,
            drift_false_alarm_rate=args.drift_false_alarm_rate,
            drift_warmup=args.drift_warmup,
            retrain_min_logged=args.retrain_min_logged,
            tensor_parallel_size=args.tensor_parallel_size,
            retrain_via=args.retrain_via,
            market_url=args.market,
            identity=args.identity,
            budget=args.budget,
            budget_period_s=args.budget_period_s,
            max_price=args.max_price,
            retrain_deadline_s=args.retrain_deadline_s,
            retrain_results_to=args.retrain_results_to,
            retrain_export_url=args.retrain_export_url,
        ),
    )
    return 0
