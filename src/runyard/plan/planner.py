"""`runyard plan`: the whole plan of a spec, with time and memory measured on the machine at hand.

`make_plan` puts together, for every task and every registered family:
1. the data's facts and its preparation time (dataprep.py, calibrated on a sample);
2. the family recommended for the data and the hardware to train and serve on (recommend.py);
3. per stage: parameters, units, FLOPs (sizing.py); the time of its training steps, periodic evaluations
   and checkpoints, from real training steps of its own model here for a time budget (calibrate.py; the
   loop's families: decoders, the CNN), or real fits of row samples of the user's table (fit_calibration.py;
   trees, the linear model), or, where neither can run, from FLOPs at the measured matmul rate times a
   stated utilisation; its memory, counting the framework, model state, activations, the evaluation batch
   and the loader;
4. the final phase: a language model's held-out and train-sample evaluation, export, samples and report;
   a table's or images' linear baseline fit or test predictions, and the run's fixed costs (start-up,
   environment lock, reports and plots, export and ONNX) measured once per machine (fixed_costs.py);
5. the same training on the recommended hardware by the device table, its energy and its cost, and the
   requirement (that hardware and a duration covering the estimate);
5a. each stage's parallel layout on the hardware the run will get (layout_choice.py: DDP, FSDP, activation
   checkpointing, tensor parallel in a node), with its reasons; the interconnect it needs goes into the
   requirement, and a layout the spec names that the hardware cannot hold is a SpecError;
6. with traffic, the serving hardware, the inference cost per day and the day it overtakes training
   (system/processes.py).

On a CPU the process's peak memory is the framework plus the data stage's peak plus each stage's step peak
in turn: glibc keeps the heap pages an earlier phase freed, so they stay resident (measured on the stdlib
demo: the full stage's peak sat on top of the smoke stage's and the data stage's). The calibration runs the
stages in the run's order in one process, so each stage's measured peak is what it adds on top of the
earlier ones, as in the run. On a GPU each stage's memory is its own (the caching allocator reuses what an
earlier stage freed).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runyard.data.shards import dtype_for_vocab
from runyard.data.sources import InputFile
from runyard.data.tokenize import CHUNK_BYTES, cpu_count
from runyard.market.requirement import Interconnect
from runyard.model.registry import FamilyUnavailable, get_family
from runyard.plan import sizing
from runyard.plan.calibrate import (
    Machine,
    StageCalibration,
    calibrate_stage,
    fits_here,
    measure_machine,
    resident_bytes,
    table_machine,
)
from runyard.plan.cost import Cost, cost_of
from runyard.plan.dataprep import DataEstimate, estimate_data
from runyard.plan.devices import UTILISATION
from runyard.plan.disk import checkpoint_bytes, export_bytes
from runyard.plan.fit_calibration import FitCalibration, calibrate_fit, table_facts_of
from runyard.plan.fixed_costs import FixedCosts, fixed_costs
from runyard.plan.layout_choice import LayoutChoice, run_interconnect, stage_layout, target_hardware
from runyard.plan.lifetime import Capacity, Lifetime, Traffic, lifetime_of, serving_kinds, table_capacity
from runyard.plan.recommend import DATA_KINDS, DataFacts, FamilyChoice, Hardware, recommend_family
from runyard.plan.serving_capacity import PredictProbe, measured_timing
from runyard.plan.task_data import check_task_data
from runyard.plan.weights_in import run_vocab
from runyard.spec.job import JobSpec, resolved_stage, with_family
from runyard.system.cpus import choose_threads

# Stated costs of a language model's steps not worth timing (seconds), and rates of ones too cheap to
# calibrate. A table's or images' fixed costs are measured instead (plan/fixed_costs.py).
STAGE_SETUP_S = 0.5  # building the model and optimizer, the gates record
REPORT_S = 2.0  # report.md/json and two PNG curves (matplotlib)
REREAD_LIMIT_S = 10.0  # a table or images read faster than this is read again, warm (task_data_phases)
UNIGRAM_TOKENS_PER_S = 20e6  # counting the training split's tokens for the unigram baseline
BPE_BASE_BYTES = 24 << 20  # HF tokenizers' BPE trainer: fixed part, measured on the stdlib corpus
BPE_BYTES_PER_BYTE = 8  # ... and per byte of training text
ENCODING_BYTES_PER_BYTE = 22  # tokenizers' Encoding objects per byte of text in flight (two chunks)
TEXT_OVERHEAD_PER_BYTE = 1.2  # cleaned documents held as Python strings


@dataclass
class StageEstimate:
    plan: sizing.StagePlan
    phases: dict[str, float]  # seconds on the machine at hand
    how: str
    memory: sizing.MemoryEstimate
    calibration: StageCalibration | None = None
    fit: FitCalibration | None = None  # a family fit by its own library: its fits of row samples here
    baseline_fit: FitCalibration | None = None  # the linear baseline a trees run fits beside its model

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict:
        out = asdict(self.plan)
        out.update(estimated_seconds=self.seconds, phases=self.phases, how=self.how,
                   memory=self.memory.to_dict(), memory_per_device_bytes=self.memory.total,
                   calibration=asdict(self.calibration) if self.calibration else None,
                   fit_calibration=asdict(self.fit) if self.fit else None,
                   baseline_fit_calibration=asdict(self.baseline_fit) if self.baseline_fit else None)
        return out


@dataclass
class Plan:
    spec_name: str
    task: str
    machine: Machine
    data: DataEstimate
    family: FamilyChoice
    stages: list[StageEstimate]
    final_phases: dict[str, float]
    peak_memory_bytes: int
    memory_how: str
    training: Hardware
    training_seconds: float  # on the recommended hardware (device table), plus data and final phases here
    training_cost: Cost
    here_cost: Cost
    requirement: dict
    lifetime: Lifetime | None = None
    calibration_s: float = 0.0
    warnings: list[str] = field(default_factory=list)
    layouts: list[LayoutChoice] = field(default_factory=list)  # per stage trained by the loop
    fixed: FixedCosts | None = None  # a table's or images' run: start-up, environment, reports, export

    @property
    def fixed_seconds(self) -> float:
        return run_fixed_seconds(self.fixed)

    @property
    def total_seconds(self) -> float:
        """Wall time of the whole run on the machine at hand."""
        return (self.data.seconds + sum(s.seconds for s in self.stages) + sum(self.final_phases.values())
                + self.fixed_seconds)

    def to_dict(self) -> dict:
        return {
            "spec": self.spec_name,
            "task": self.task,
            "machine": asdict(self.machine),
            "data": self.data.to_dict(),
            "family": asdict(self.family),
            "stages": [s.to_dict() for s in self.stages],
            "final_phases": self.final_phases,
            "estimated_seconds": self.total_seconds,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_how": self.memory_how,
            "training_flops": sum(s.plan.training_flops for s in self.stages),
            "recommended_training": self.training.to_dict(),
            "recommended_training_seconds": self.training_seconds,
            "cost": self.training_cost.to_dict(),
            "cost_here": self.here_cost.to_dict(),
            "requirement": self.requirement,
            "lifetime": self.lifetime.to_dict() if self.lifetime else None,
            "calibration_s": self.calibration_s,
            "warnings": self.warnings,
            "layouts": [c.to_dict() for c in self.layouts],
            "fixed_costs": asdict(self.fixed) if self.fixed else None,
        }


def run_fixed_seconds(fixed: FixedCosts | None) -> float:
    """A run's fixed costs outside its stages (each stage counts its own setup among its phases)."""
    return fixed.seconds - fixed.parts.get("stage setup", 0.0) if fixed else 0.0


def run_threads(spec: JobSpec) -> int:
    """The CPU threads each of the run's processes will use (runyard/system/cpus.py), so calibration measures
    the machine as the run will use it."""
    return choose_threads(spec.resources.threads, spec.resources.nproc).threads


def make_plan(spec: JobSpec, files: list[InputFile], run_dir: Path, *, calibrate: bool = True,
              traffic: Traffic | None = None, cache_dir: Path | None = None, budget_s: float = 3.0,
              serving_probe: PredictProbe | None = None) -> Plan:
    """The whole plan (see the module doc). `calibrate=False` measures nothing and uses the device table
    for the machine at hand too. `serving_probe` times a table or image model's /v1/predict here
    (run/serving_probe.py; the serving stack sits above the planner)."""
    started = time.perf_counter()
    framework = resident_bytes()
    if calibrate:
        machine = measure_machine(spec.resources.device, run_threads(spec), run_dir)
    else:
        machine = table_machine("cpu", spec.resources.threads or cpu_count())
    if spec.data is None:
        data = no_top_level_data(spec)
    else:
        data = estimate_data(spec.task, spec.data, spec.seed, files,
                             machine.devices if machine.kind == "cpu" else cpu_count(), cache_dir, measure=calibrate)
    facts = dict(data.facts.config_facts(spec.task))
    facts.setdefault("vocab_size", run_vocab(spec))
    table = data.extra.get("table")
    if table is not None:  # the config the run builds: the prepared table's own facts (categorical columns)
        facts["table"] = table_facts_of(table)
    choice = recommend_family(spec.task, data.facts)
    warnings = []
    unnamed = any(resolved_stage(spec, s.name).model.family is None for s in spec.stages)
    if unnamed and choice.family is None:
        raise FamilyUnavailable(f"nothing to plan: {choice.why}")
    if unnamed:
        # What the run does with model.family left out: the data's recommendation trains (run/predictive.py).
        spec = with_family(spec, choice.family)
    elif choice.family is not None and any(resolved_stage(spec, s.name).model.family != choice.family
                                           for s in spec.stages):
        warnings.append(f"the spec's model.family differs from the recommendation {choice.family!r}: {choice.why}")

    train_rows = (int((data.facts.rows or 0) * (1 - spec.data.heldout_fraction))
                  if data.facts.rows and spec.data is not None else None)
    loader = _loader_bytes(data, facts["vocab_size"])
    plans = [sizing.plan_stage(spec, s.name, data_facts=facts, framework=framework, loader=loader, train_rows=train_rows)
             for s in spec.stages]
    # The layout before any calibration: a layout the spec names that cannot fit is a SpecError at once.
    target = target_hardware(spec, sizing.recommended_training(spec, plans))
    layouts = [c for c in (stage_layout(spec, s.name, target, facts) for s in spec.stages) if c is not None]
    # In the run's order: each stage's measured peak then sits on what the earlier ones left resident,
    # as it will in the run (module doc).
    stages = [_estimate_stage(spec, p, machine, facts, calibrate, budget_s, table) for p in plans]
    fixed = None
    if spec.task != "language_model":
        fixed = fixed_costs(spec.task, stages[-1].plan.family, run_threads(spec), measure=calibrate)
        data = task_data_phases(spec, data, calibrate)
        for s in stages:
            s.phases["setup"] = fixed.parts.get("stage setup", STAGE_SETUP_S)
        final = task_final_phases(spec, stages[-1], data)
    else:
        final = _final_phases(spec, stages[-1], data, machine, facts["vocab_size"])
    fixed_s = run_fixed_seconds(fixed)
    peak, memory_how = _peak_memory(spec, machine, framework, data, stages)
    hardware = sizing.recommended_training(spec, [s.plan for s in stages])
    on_hardware = sizing.device_table_seconds([s.plan for s in stages], hardware, spec.task, spec)
    if hardware.kind == machine.kind and machine.calibrated:
        on_hardware = sum(s.seconds for s in stages) * machine.devices / hardware.devices
    training_seconds = data.seconds + on_hardware + sum(final.values()) + fixed_s
    training_cost = cost_of(hardware.kind, hardware.devices, training_seconds, spec.costs)
    here = _here_cost(spec, machine, data.seconds + sum(s.seconds for s in stages) + sum(final.values()) + fixed_s)
    warnings += layout_warnings(spec, layouts)
    requirement = sizing.requirement_for(spec, hardware, training_seconds,
                                         run_interconnect(layouts)).model_dump(mode="json")
    plan = Plan(spec.name, spec.task, machine, data, choice, stages, final, peak, memory_how, hardware,
                training_seconds, training_cost, here, requirement, warnings=warnings, layouts=layouts, fixed=fixed)
    if traffic is not None:
        plan.lifetime = lifetime_for(spec, plan, traffic, serving_probe if calibrate else None)
    plan.calibration_s = time.perf_counter() - started
    return plan


def no_top_level_data(spec: JobSpec) -> DataEstimate:
    """The data estimate of a spec without top-level data (every stage sft or dpo on its own records): nothing
    to prepare at the top level; the tokenizer is the initial weights'."""
    vocab = run_vocab(spec)
    return DataEstimate(DataFacts(kind="text", files=0, bytes=0, rows=0, tokens=0, vocab_size=vocab), 0.0, {},
                        "no top-level data: every stage is sft or dpo on its own records, with the initial weights' "
                        f"tokenizer ({vocab:,} tokens)", cached=True)


def layout_warnings(spec: JobSpec, layouts: list[LayoutChoice]) -> list[str]:
    """A stage no layout holds; stages wanting different `resources.parallel` (one for the run); a layout
    needing NVLink where the spec's requirement accepts a weaker link."""
    out = [f"{c.describe()}: {c.reasons()[-1]}" for c in layouts if c.chosen is None]
    parallels = {json.dumps(c.chosen.parallel) for c in layouts if c.chosen is not None and not c.explicit}
    if len(parallels) > 1:
        out.append("the stages' layouts differ (" + "; ".join(c.describe() for c in layouts if c.chosen) + "), and "
                   "resources.parallel is one for the run: set the one that holds every stage")
    given = spec.resources.requirement
    if ("requirement" in spec.resources.model_fields_set and "min_interconnect" in given.model_fields_set
            and run_interconnect(layouts) == Interconnect.NVLINK.value and given.min_interconnect != Interconnect.NVLINK):
        out.append(f"tensor parallel needs nvlink within a node, and resources.requirement.min_interconnect "
                   f"accepts {given.min_interconnect.value}")
    return out


def layout_lines(plan: Plan) -> list[str]:
    """Each stage's layout and the steps that chose it, as `runyard plan` prints them."""
    out = []
    for choice in plan.layouts:
        out.append(f"layout: {choice.describe()}")
        out += [f"  {reason}" for reason in choice.reasons()]
    return out


def _loader_bytes(data: DataEstimate, vocab: int) -> int:
    """Token shards a run maps: every token of both splits, resident once read."""
    tokens = data.facts.tokens or 0
    return tokens * dtype_for_vocab(vocab).itemsize


def _estimate_stage(spec: JobSpec, plan: sizing.StagePlan, machine: Machine, facts: dict[str, Any],
                    calibrate: bool, budget_s: float, table: Any = None) -> StageEstimate:
    stage = resolved_stage(spec, plan.stage)
    family, config = sizing.stage_config(spec, stage, facts)
    size = family.sizing(config, micro_batch=stage.train.batch_size)
    if calibrate and not family.trains_with_loop and table is not None:
        # A family fit by its own library: real fits of row samples of the user's table (fit_calibration.py).
        threads = run_threads(spec)
        fit = calibrate_fit(family, config, table, spec.seed, threads, budget_s)
        baseline = None
        if family.name != "linear" and plan.stage == spec.stages[-1].name:  # the run's linear baseline
            linear = get_family("linear")
            baseline = calibrate_fit(linear, linear.config_from_spec(stage.model, table=facts["table"]), table,
                                     spec.seed, threads, budget_s / 3)
        phases = {"training": fit.estimate_s, "setup": STAGE_SETUP_S}
        return StageEstimate(plan, phases, fit.describe(), stage_memory(plan, None), fit=fit, baseline_fit=baseline)
    calibration = None
    if calibrate and family.trains_with_loop and fits_here(size.parameters, size.activation_bytes, machine):
        calibration = calibrate_stage(plan.stage, family, config, stage.optim, stage.train.batch_size, machine,
                                      spec.resources.precision, run_threads(spec), budget_s=budget_s,
                                      decode=plan.stage == spec.stages[-1].name,
                                      recompute=(stage.train.activation_checkpointing,
                                                 stage.train.activation_checkpointing_every))
    phases, how = stage_phases(spec, plan, machine, calibration)
    return StageEstimate(plan, phases, how, stage_memory(plan, calibration), calibration)


def stage_phases(spec: JobSpec, plan: sizing.StagePlan, machine: Machine,
                 calibration: StageCalibration | None) -> tuple[dict[str, float], str]:
    """Seconds of a stage's training steps, periodic evaluations, checkpoints and setup on `machine`, from
    its calibration (steps x (grad_accum x forward-backward + optimizer) + the first step's extra;
    evaluations x eval.batches x a forward pass) or else from its FLOPs at the matmul rate times the
    stated utilisation; and how they were found."""
    stage = resolved_stage(spec, plan.stage)
    t = stage.train
    # Ranks on one CPU share its cores: a step of `nproc` micro-batches takes `nproc` times as long.
    shared = spec.resources.nproc if machine.kind == "cpu" else 1
    evaluations = t.steps // spec.eval.interval + (1 if t.steps % spec.eval.interval else 0)
    checkpoints = t.steps // spec.checkpoint.interval + (1 if t.steps % spec.checkpoint.interval else 0)
    phases: dict[str, float] = {}
    if calibration is not None:
        step = t.grad_accum * calibration.forward_backward_s + calibration.optimizer_s
        phases["training"] = (t.steps * step + calibration.first_step_extra_s) * shared
        phases["evaluation"] = evaluations * spec.eval.batches * calibration.forward_s * shared
        how = (f"calibrated: {calibration.steps} real step{'s' if calibration.steps != 1 else ''} of this model at "
               f"micro-batch {t.batch_size} here ({calibration.forward_backward_s + calibration.optimizer_s:.3g} s a step"
               f" (median), spread {calibration.spread:.0%} across steps)")
    else:
        util = UTILISATION["cpu_of_matmul_peak"] if machine.kind == "cpu" else UTILISATION["train_other"]
        rate = machine.matmul_flops * util
        phases["training"] = plan.training_flops / rate * shared
        phases["evaluation"] = plan.evaluation_flops / rate * shared
        how = (f"FLOPs at {util:.0%} of {'the measured' if machine.calibrated else 'the table'} matmul rate "
               f"({machine.matmul_flops / 1e9:.1f} GFLOP/s)")
    if get_family(plan.family).trains_with_loop:
        # Each checkpoint written, and the final one read back by the round-trip gate.
        phases["checkpoints"] = (checkpoints + 1) * checkpoint_bytes(plan.parameters) / machine.disk_write_bytes_s
    phases["setup"] = STAGE_SETUP_S
    return phases, how


def stage_memory(plan: sizing.StagePlan, calibration: StageCalibration | None) -> sizing.MemoryEstimate:
    """The stage's memory: stated (sizing.memory_estimate), or with activations and the evaluation batch
    replaced by the calibration's measured peak over the framework, less the model state."""
    memory = sizing.MemoryEstimate(**{k: v for k, v in plan.memory.items() if k != "total"})
    if calibration is None or calibration.peak_bytes is None:
        return memory
    return sizing.MemoryEstimate(memory.framework, memory.states, max(0, calibration.peak_bytes - memory.states), 0,
                                 memory.loader, "measured: the peak of real steps and a held-out forward here, "
                                 "over what was resident before")


def _final_phases(spec: JobSpec, last: StageEstimate, data: DataEstimate, machine: Machine, vocab: int) -> dict[str, float]:
    """Held-out and train-sample evaluation, the unigram baseline, the export (written and loaded again),
    the samples and the report."""
    stage = resolved_stage(spec, last.plan.stage)
    batch = stage.train.batch_size
    out: dict[str, float] = {}
    cal = last.calibration
    if cal is not None:
        heldout_tokens = int(data.facts.extra.get("heldout_tokens", 0))
        context = max(1, last.plan.tokens // max(1, stage.train.steps * batch * stage.train.grad_accum
                                                   * spec.resources.nproc))
        sequences = min(spec.eval.final_batches * batch, heldout_tokens // (context + 1)) if heldout_tokens else \
            spec.eval.final_batches * batch
        batches = math.ceil(sequences / batch)
        out["final evaluation"] = 2 * batches * cal.forward_s  # held-out, and a train sample of the same size
        out["unigram baseline"] = int(data.facts.extra.get("train_tokens", 0)) / UNIGRAM_TOKENS_PER_S
        decode = cal.decode_token_s or 0.0
        out["samples"] = len(spec.eval.prompts) * spec.eval.sample_tokens * decode
    else:
        flops = last.plan.flops_per_token / 3 * spec.eval.final_batches * batch * 2
        out["final evaluation"] = flops / (machine.matmul_flops * UTILISATION["cpu_of_matmul_peak"])
    weights = export_bytes(last.plan.parameters, vocab)
    out["export"] = 2 * weights / machine.disk_write_bytes_s  # written, then loaded back for the samples
    out["report"] = REPORT_S
    return out


def task_data_phases(spec: JobSpec, data: DataEstimate, measure: bool) -> DataEstimate:
    """A table's or images' data phase as the run spends it: the pre-flight check reads every row, then the
    data stage reads them again; the report is a fixed cost. The plan's first read paid the reader's
    imports, which the fixed costs' start-up holds already, so a short read is timed again, warm."""
    read = data.parts.get("read", 0.0)
    if measure and read < REREAD_LIMIT_S:
        read = check_task_data(spec.task, spec.data, spec.seed).seconds
    parts = {"pre-flight read": read, "read": read}
    return DataEstimate(data.facts, sum(parts.values()), parts, data.how.replace("; the report stated", ""),
                        data.cached, data.bytes_per_token, data.kept_fraction, data.text_bytes, data.extra)


def task_final_phases(spec: JobSpec, last: StageEstimate, data: DataEstimate) -> dict[str, float]:
    """A table's or images' final phase beyond its fixed costs: the trees' linear baseline fit on the whole
    table (calibrated like the stage), and the images' test predictions (the calibration's forward pass)."""
    out: dict[str, float] = {}
    if last.baseline_fit is not None:
        out["linear baseline"] = last.baseline_fit.estimate_s
    cal = last.calibration
    if cal is not None and spec.task == "image_classification" and data.facts.rows:
        test = int(data.facts.rows * spec.data.heldout_fraction)
        out["test predictions"] = test / cal.micro_batch * cal.forward_s
    return out


def data_peak_bytes(spec: JobSpec, data: DataEstimate) -> int:
    """The data stage's peak over the framework: the cleaned text held as strings, and the larger of the BPE
    trainer's memory and the encodings of the two chunks in flight (constants measured on the stdlib corpus
    with tokenizers 0.23). A prepared dataset costs nothing; tables and images are held once, as read."""
    if data.facts.kind != "text":
        return int(data.facts.bytes * TEXT_OVERHEAD_PER_BYTE)
    if data.cached:
        return 0
    kept = data.text_bytes or data.facts.bytes
    bpe = 0
    if spec.data.tokenizer.path is None:
        trained = min(int(kept * (1 - spec.data.heldout_fraction)), spec.data.tokenizer.train_max_bytes)
        bpe = BPE_BASE_BYTES + BPE_BYTES_PER_BYTE * trained
    return int(kept * TEXT_OVERHEAD_PER_BYTE + max(bpe, ENCODING_BYTES_PER_BYTE * min(kept, 2 * CHUNK_BYTES)))


def _peak_memory(spec: JobSpec, machine: Machine, framework: int, data: DataEstimate,
                 stages: list[StageEstimate]) -> tuple[int, str]:
    """The run's peak: on a CPU, the process's (module doc); on a GPU, the largest stage's per device."""
    if machine.kind != "cpu":
        return max(s.memory.total for s in stages), "per device: the largest stage's"
    data_peak = data_peak_bytes(spec, data)
    stage_peaks = sum(s.memory.total - s.memory.framework - s.memory.loader for s in stages)
    loader = stages[0].memory.loader if stages else 0
    peak = framework + data_peak + loader + stage_peaks
    return peak, ("process resident memory: the framework (measured), the data stage's peak, the token shards "
                  "and each stage's peak in turn (freed heap stays resident)")


def _here_cost(spec: JobSpec, machine: Machine, seconds: float) -> Cost:
    return cost_of(machine.kind, machine.devices, seconds, spec.costs)


def lifetime_for(spec: JobSpec, plan: Plan, traffic: Traffic, probe: PredictProbe | None = None) -> Lifetime:
    """Training cost against serving on the cheapest hardware for the traffic; a table or image model's
    capacity from its /v1/predict timed here by `probe` (else stated figures)."""
    last = plan.stages[-1]
    stage = resolved_stage(spec, last.plan.stage)
    facts = dict(plan.data.facts.config_facts(spec.task))
    facts.setdefault("vocab_size", run_vocab(spec))
    family, config = sizing.stage_config(spec, stage, facts)
    size = family.sizing(config)
    timing = None
    if probe is not None and traffic.unit == "row":
        timing = measured_timing(probe, spec.task, family.name, config, family.config_to_dict(config))
    capacities = []
    for kind in serving_kinds(spec.task):
        capacities.append(_measured_capacity(kind, plan, traffic)
                          or table_capacity(kind, spec.task, size, traffic, timing, family.trains_with_loop))
    return lifetime_of(spec.task, plan.training_cost, capacities, traffic, spec.costs)


def _measured_capacity(kind: str, plan: Plan, traffic: Traffic) -> Capacity | None:
    """A CPU core's decoding rate from the calibration here, when the machine at hand is a CPU."""
    cal = plan.stages[-1].calibration
    if kind != "cpu" or plan.machine.kind != "cpu" or cal is None or not plan.machine.calibrated:
        return None
    cores = plan.machine.devices
    if traffic.unit == "token" and cal.decode_token_s:
        return Capacity("cpu", 1, 1 / cal.decode_token_s / cores,
                        f"measured here: {1 / cal.decode_token_s:,.0f} tokens/s decoding one sequence on {cores} cores")
    return None


def traffic_from(spec: JobSpec, requests_per_day: float | None, tokens_per_request: int | None,
                 rows_per_request: int | None) -> Traffic | None:
    """The traffic the command line gives, else the spec's `traffic` section, else None."""
    section = spec.traffic
    if requests_per_day is None and section is None:
        return None
    requests = requests_per_day if requests_per_day is not None else section.requests_per_day
    kind = DATA_KINDS[spec.task]
    peak = section.peak_to_mean if section else 2.0
    horizon = section.horizon_days if section else 365
    if kind == "text":
        tokens = tokens_per_request or (section.tokens_per_request if section else None)
        units = tokens or resolved_stage(spec, spec.stages[-1].name).model.context_length
        return Traffic(requests, units, "token", peak, horizon)
    rows = rows_per_request or (section.rows_per_request if section else None) or 1
    return Traffic(requests, rows, "row", peak, horizon)

