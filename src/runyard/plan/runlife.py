"""The lifetime of a finished run, for its evaluation report: what training it really took here against
what serving it will cost, when the spec gives `traffic`.

Training is measured: the data stage's timings and each stage's span in its metrics log (first to last
step, plus one step for the first), on the devices this run used (the CPU threads, or one GPU), priced at
`costs`. Serving a language model is measured on the exported model here for a CPU core (single-sequence
decoding) when this machine is a CPU, and estimated from the device table for the other kinds; every kind is
a candidate and the cheapest day wins (lifetime.py). Only language-model runs report a lifetime here; a table
or image model's serving capacity is measured by `runyard plan` on its /v1/predict (serving_capacity.py).
"""

from __future__ import annotations

from typing import Any

import torch

from runyard.model.registry import get_family
from runyard.plan.calibrate import decode_token_seconds
from runyard.plan.cost import cost_of
from runyard.plan.devices import kind_of_cuda_name
from runyard.plan.lifetime import Capacity, Lifetime, lifetime_of, serving_kinds, table_capacity
from runyard.plan.planner import traffic_from
from runyard.spec.job import JobSpec, resolved_stage


def training_seconds(data_stats: dict, stage_metrics: dict[str, list[dict]]) -> float:
    """What the run's data stage and stages took: the data stage's recorded timings, and each stage's
    span between its first and last logged steps plus one mean step (the first step's own time)."""
    total = sum(float(v) for v in (data_stats.get("timings") or {}).values())
    for rows in stage_metrics.values():
        times = [r["time"] for r in rows if "time" in r]
        if len(times) >= 2:
            span = times[-1] - times[0]
            total += span + span / (len(times) - 1)
    return total


def machine_kind(device: torch.device) -> tuple[str, int]:
    """(device-table kind, devices) of what this process trained on."""
    if device.type == "cuda":
        return kind_of_cuda_name(torch.cuda.get_device_name(device)) or "h100-80gb", 1
    return "cpu", torch.get_num_threads()


def run_lifetime(spec: JobSpec, model: torch.nn.Module, config: Any, device: torch.device, data_stats: dict,
                 stage_metrics: dict[str, list[dict]]) -> Lifetime | None:
    """The run's lifetime (module doc); None when the spec has no traffic."""
    traffic = traffic_from(spec, None, None, None)
    if traffic is None:
        return None
    kind, devices = machine_kind(device)
    training = cost_of(kind, devices, training_seconds(data_stats, stage_metrics), spec.costs)
    stage = resolved_stage(spec, spec.stages[-1].name)
    family = get_family(stage.model.family)
    size = family.sizing(config)
    capacities = []
    for serve_kind in serving_kinds(spec.task):
        measured = _measured(serve_kind, kind, devices, model, device, traffic.unit)
        capacities.append(measured or table_capacity(serve_kind, spec.task, size, traffic))
    return lifetime_of(spec.task, training, capacities, traffic, spec.costs)


def _measured(serve_kind: str, here: str, cores: int, model, device, unit: str) -> Capacity | None:
    if serve_kind != here or here != "cpu" or unit != "token":
        return None
    seconds = decode_token_seconds(model, device)
    if not seconds:
        return None
    return Capacity("cpu", 1, 1 / seconds / cores,
                    f"measured on the export here: {1 / seconds:,.0f} tokens/s decoding one sequence on {cores} cores")
