"""Fine-tuning throughput: runyard's SFT step against trl's SFTTrainer on the same HF Llama-shaped model,
the same data and the same batches, on CPU; and LoRA's peak memory against a full fine-tune.

Data: instruction pairs built from this interpreter's standard library (prompt: a function's signature
and docstring; response: its body), prepared by runyard's data stage (`python_functions` source, default
chat template) with a BPE trained on the same sources. Both sides train on the same padded batches:
runyard's length-grouped sample loader draws them; trl gets the same samples in the same order (a
pre-tokenized dataset with `completion_mask`, `train_sampling_strategy="sequential"`), its collator pads
each batch to its longest sample on the right, as runyard's does. Neither side packs or runs padding-free
(`packing=False`, `padding_free=False` on trl's). The loss on both sides covers the response tokens only,
normalised by the supervised tokens of the step.

Models: runyard's Transformer, and transformers' LlamaForCausalLM (sdpa attention) with runyard's weights
copied in (the logits are checked to agree before anything is timed). Both use AdamW (fused: transformers'
default `adamw_torch_fused`, and runyard's loop's), the same learning rate, and clip gradients to norm 1.0.
Both run in fp32 without activation recomputation: trl's defaults (`gradient_checkpointing=True`, bf16
autocast where the CPU has it) are turned off, since runyard's side has neither; a comparison with either on
would measure the setting, not the trainer.

- runyard: the step its training loop runs for an sft stage (train/stage_kinds.py's SFTObjective: masked
  loss summed over each micro-batch, scaled by the step's supervised tokens, backward, clip, AdamW step),
  drawing each batch from its sample loader inside the timed span.
- trl: `SFTTrainer`, built once, with logging and saving off (its documented settings for a pre-tokenized
  prompt/completion dataset: completion_only_loss). Each round calls `train()` for the same steps, and a
  callback times the steps alone, from `on_train_begin` (after trl has built its optimizer, accelerator
  and loader) to the last `on_step_end`; its loader's fetching and collation fall inside that span, as
  runyard's do. Each round starts both sides with a fresh AdamW (no state), built outside the timed span.

Figures: tokens/s (input tokens that are not padding) of runyard over trl; the share of padding in the
batches (length-grouped vs plainly shuffled, against packing); and the peak RSS of a LoRA fine-tune over
a full fine-tune of the same model and batches, each in its own fresh subprocess.

Run: python benchmarks/finetune_throughput.py [--record]   (needs the `bench` extra: transformers, trl)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput as tt  # noqa: E402
from harness import Report, Samples, add_common_args, paired_ratio  # noqa: E402

from runyard.data.instruct import prepare_instruct  # noqa: E402
from runyard.data.samples import Batch, SampleLoader  # noqa: E402
from runyard.data.sources import expand_path_template  # noqa: E402
from runyard.data.tokenizer import EOS_TOKEN, train_bpe  # noqa: E402
from runyard.model.compute import token_loss_sum  # noqa: E402
from runyard.model.config import default_ffn_hidden  # noqa: E402
from runyard.model.transformer import ModelConfig, Transformer  # noqa: E402
from runyard.spec.data_instruct import InstructDataSpec  # noqa: E402
from runyard.spec.finetune import LoRASpec  # noqa: E402
from runyard.train.lora import apply_lora  # noqa: E402

LR = 3e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The trl peer: SFTTrainer built once, fp32 (bf16=False), gradient_checkpointing=False, no packing "
        "or padding-free on either side; each round's trl steps are timed by a callback from on_train_begin to the "
        "last on_step_end (its optimizer, accelerator and loader setup left out), runyard's from its loader to its "
        "last step. Needs the bench extra (transformers, trl, datasets) to run; --help does not.",
    )
    p.add_argument("--d-model", type=int, default=256, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--context", type=int, default=384, help="longest sample, tokens (longer ones are dropped)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary")
    p.add_argument("--batch", type=int, default=8, help="samples per step")
    p.add_argument("--steps", type=int, default=8, help="timed steps per contender per round")
    # LoRA saves the base's gradients and optimizer state, not activations: the comparison uses a model
    # whose parameters weigh more than one small batch's activations, as in LoRA's use.
    p.add_argument("--memory-d-model", type=int, default=768, help="hidden size of the memory comparison's model")
    p.add_argument("--memory-batch", type=int, default=2, help="samples per step in the memory comparison")
    p.add_argument("--memory-layers", type=int, default=8, help="layers of the memory comparison's model")
    p.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    p.add_argument("--workdir", default=None, help="where the prepared data goes (default: a temporary folder)")
    p.add_argument("--memory-only", choices=("full", "lora"), help=argparse.SUPPRESS)
    add_common_args(p, repeats=5)
    return p.parse_args(argv)


def prepare(args: argparse.Namespace, work: Path):
    """The tokenizer (BPE on the stdlib modules the pairs come from) and the prepared instruction pairs."""
    tok_path = work / "tokenizer.json"
    pattern = "{stdlib}/[a-m]*.py"
    if not tok_path.exists():
        files = sorted(Path(expand_path_template("{stdlib}")).glob("[a-m]*.py"))
        train_bpe((f.read_text(errors="replace") for f in files), args.vocab, 2, 20_000_000).save(str(tok_path))
    spec = InstructDataSpec.model_validate({
        "sources": [{"path": pattern, "format": "python_functions", "max_body_lines": 30}],
        "heldout_fraction": 0.05, "length_grouping": 16,
    })
    return tok_path, spec, prepare_instruct(spec, "sft", tok_path, args.context, args.seed, work / "cache")


def model_config(args: argparse.Namespace, vocab: int, d_model: int | None = None, layers: int | None = None) -> ModelConfig:
    d = d_model or args.d_model
    return ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers or args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, ffn_hidden=default_ffn_hidden(d), context_length=args.context)


def draw_batches(prepared, args: argparse.Namespace, n: int, grouping: int = 16) -> tuple[list[Batch], list[int]]:
    """`n` batches as runyard's loader draws them, and the sample ids they hold, in order."""
    loader = SampleLoader(prepared.stores("train"), args.batch, args.seed, prepared.pad_id, length_grouping=grouping)
    batches, ids = [], []
    for _ in range(n):
        ids.extend(int(i) for i in loader.sample_ids(loader.position))
        batches.append(loader.next_batch())
    return batches, ids


def runyard_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batches) -> None:
    """The sft step of runyard's loop (one micro-batch per step, one process) over `batches` (a list, or
    a generator that draws them from the loader as the loop does)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for b in batches:
        loss = token_loss_sum(model(b.inputs), b.labels) * (1.0 / b.supervised)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def runyard_round(model: torch.nn.Module, prepared, args: argparse.Namespace) -> float:
    """Seconds of one round of runyard's steps: a fresh AdamW built untimed, then the loader (at the same
    start each round, so the same batches) and `args.steps` steps timed."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    t0 = time.perf_counter()
    loader = SampleLoader(prepared.stores("train"), args.batch, args.seed, prepared.pad_id, length_grouping=16)
    runyard_steps(model, opt, (loader.next_batch() for _ in range(args.steps)))
    return time.perf_counter() - t0


def step_timer():
    """A trl callback that times the steps of each `train()` call (from on_train_begin, after trl's setup, to
    the last on_step_end) and keeps the seconds of the latest call in `.seconds`."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        seconds = float("nan")

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.t0

    return StepTimer()


def trl_round(trainer, timer) -> float:
    """Seconds of one round of trl's steps (trainer.train(), timed by `timer` over its steps alone)."""
    timer.seconds = float("nan")
    trainer.train()
    if not math.isfinite(timer.seconds):
        raise RuntimeError("trl's trainer ran no step; the timing callback saw none")
    return timer.seconds


def interleaved_rounds(contenders: dict, repeats: int, warmup: int = 1) -> dict[str, Samples]:
    """As harness.interleaved, but each contender returns the seconds of its own timed span (setup left out)."""
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    out = {name: Samples() for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].values.append(contenders[name]())
        print(f"round {r + 1}/{repeats}: " + ", ".join(f"{n} {out[n].values[-1]:.3f} s" for n in names), flush=True)
    return out


def trl_dataset(prepared, ids: list[int]):
    """The samples `ids`, in order, as trl's pre-tokenized prompt/completion rows."""
    from datasets import Dataset  # the bench extra's peers (datasets, transformers, trl) load only to run

    store = prepared.stores("train")[0]
    rows = []
    for i in ids:
        tokens, mask = store.sample(i)
        rows.append({"input_ids": tokens.tolist(), "completion_mask": mask.tolist()})
    return Dataset.from_list(rows)


def trl_trainer(hf: torch.nn.Module, dataset, args: argparse.Namespace, out: Path, tokenizer_path: Path, callbacks=()):
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    # fp32 without recomputation, no packing, padded batches: what runyard's side does (trl's defaults turn on
    # gradient checkpointing and bf16 autocast, which would time those settings rather than the trainer).
    config = SFTConfig(
        output_dir=str(out), per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
        max_grad_norm=1.0, logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
        train_sampling_strategy="sequential", dataloader_num_workers=0, completion_only_loss=True,
        max_length=None, seed=args.seed, optim="adamw_torch_fused", disable_tqdm=True,
        gradient_checkpointing=False, bf16=False, fp16=False, packing=False, padding_free=False,
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    return SFTTrainer(model=hf, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=list(callbacks))


def peak_memory(args: argparse.Namespace, mode: str) -> int:
    """Peak RSS growth (bytes) of building and fine-tuning the memory model for 3 steps, full or LoRA."""
    work = Path(args.workdir)
    _tok, _spec, prepared = prepare(args, work)
    cfg = model_config(args, _vocab(prepared), args.memory_d_model, args.memory_layers)
    batches, _ids = draw_batches(prepared, argparse.Namespace(**{**vars(args), "batch": args.memory_batch}), 3)
    if tt._reset_peak_rss():
        before, peak = tt._proc_status_kib("VmRSS"), lambda: tt._proc_status_kib("VmHWM")
    else:
        raise SystemExit("peak memory needs Linux's /proc/self/clear_refs")
    torch.manual_seed(args.seed)
    model = Transformer(cfg)
    if mode == "lora":
        params = list(apply_lora(model, LoRASpec(rank=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
                                 args.seed).parameters())
    else:
        params = list(model.parameters())
    runyard_steps(model, torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), fused=True), batches)
    return (peak() - before) * 1024


def _vocab(prepared) -> int:
    return Tokenizer.from_file(str(prepared.tokenizer_path)).get_vocab_size()


def memory_in_subprocess(argv: list[str], mode: str, workdir: Path) -> int:
    out = subprocess.run([sys.executable, __file__, *argv, "--workdir", str(workdir), "--memory-only", mode],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_growth_bytes"]


def padding_figures(prepared, args: argparse.Namespace) -> dict[str, float]:
    """Padding share of a full epoch's batches, length-grouped and plainly shuffled, and packing's."""
    n = len(prepared.stores("train")[0]) // args.batch
    grouped, _ = draw_batches(prepared, args, n, grouping=16)
    plain, _ = draw_batches(prepared, args, n, grouping=0)

    def waste(bs):
        return 1 - sum(b.real_tokens for b in bs) / sum(b.inputs.numel() for b in bs)

    lengths = prepared.stores("train")[0].lengths - 1
    rows = math.ceil(lengths.sum() / args.context)  # packed into full rows of the context
    return {"grouped": waste(grouped), "shuffled": waste(plain), "packed": 1 - lengths.sum() / (rows * args.context)}


def attention_cost(args: argparse.Namespace) -> tuple[float, float]:
    """Seconds for one forward+backward of SDPA at the context length: causal (what padding uses) vs a
    block-diagonal causal mask (what packing needs so that samples do not attend to each other)."""
    B, H, T, D = args.batch, args.heads, args.context, args.d_model // args.heads
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    doc = torch.arange(T) // (T // 4)  # four samples per row
    mask = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()

    def run(**kw):
        t0 = time.perf_counter()
        for _ in range(5):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
        return (time.perf_counter() - t0) / 5

    run(is_causal=True), run(attn_mask=mask)  # warm up
    return run(is_causal=True), run(attn_mask=mask)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.memory_only:
        print(json.dumps({"peak_rss_growth_bytes": peak_memory(args, args.memory_only)}))
        return 0
    missing = [name for name in ("datasets", "transformers", "trl") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"finetune_throughput needs the bench extra (pip install 'runyard[bench]'); missing: {', '.join(missing)}",
              file=sys.stderr)
        return 2
    report = Report("finetune_throughput", args, packages=["transformers", "trl"])
    with tempfile.TemporaryDirectory(prefix="runyard-ft-bench-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        _tok, _spec, prepared = prepare(args, work)
        vocab = _vocab(prepared)
        cfg = model_config(args, vocab)
        batches, ids = draw_batches(prepared, args, args.steps)
        tokens = sum(b.real_tokens for b in batches)
        torch.manual_seed(args.seed)
        ours = Transformer(cfg)
        hf = tt.build_hf(cfg)
        tt.copy_weights_to_hf(ours, hf)
        with torch.no_grad():
            probe = batches[0].inputs[:2]
            diff = (ours.eval()(probe) - hf.eval()(probe).logits).abs().max().item()
        ours.train(), hf.train()
        report.note(f"{len(batches)} batches of {args.batch} samples, {tokens:,} real tokens per round; "
                    f"logits of the two models agree to {diff:.1e}")
        timer = step_timer()
        trainer = trl_trainer(hf, trl_dataset(prepared, ids), args, work / "trl", prepared.tokenizer_path, [timer])
        first = next(iter(trainer.get_train_dataloader()))
        # trl's rows are whole samples with labels aligned to them (the model shifts); runyard's are shifted.
        real = torch.arange(batches[0].inputs.shape[1]) < (first["attention_mask"].sum(1, keepdim=True) - 1)
        assert torch.equal(first["input_ids"][:, :-1][real], batches[0].inputs[real]), "trl reads the same batch"
        assert torch.equal(first["labels"][:, 1:], batches[0].labels), "trl supervises the same tokens"
        timings = interleaved_rounds({"runyard": lambda: runyard_round(ours, prepared, args),
                                      "trl": lambda: trl_round(trainer, timer)}, args.repeats)
        for name, samples in timings.items():
            print(f"{name}: {samples.rate(tokens).spread()} tokens/s", flush=True)
        report.ratio("sft_tokens_per_s_vs_trl", paired_ratio(timings["trl"], timings["runyard"]),
                     "trl SFTTrainer built once, its steps timed (fp32, gradient_checkpointing=False, no packing), "
                     "same HF Llama-shaped model, same padded batches, CPU", ">=", 1.0,
                     {"tokens_per_round": tokens, "logit_max_abs_diff": diff})

        pads = padding_figures(prepared, args)
        causal, blocked = attention_cost(args)
        report.note(f"padding share of an epoch's batches: {pads['grouped']:.1%} length-grouped (runyard's default), "
                    f"{pads['shuffled']:.1%} plainly shuffled, {pads['packed']:.1%} packed; SDPA forward+backward "
                    f"at {args.context} tokens: {causal * 1e3:.2f} ms causal vs {blocked * 1e3:.2f} ms with the "
                    "block-diagonal mask packing needs")

        full = memory_in_subprocess(argv, "full", work)
        lora = memory_in_subprocess(argv, "lora", work)
        print(f"peak RSS growth, {args.memory_layers} layers x d_model {args.memory_d_model}, batch "
              f"{args.memory_batch}, 3 steps: full "
              f"{full / 2**20:.0f} MiB, LoRA (r=8, attention) {lora / 2**20:.0f} MiB", flush=True)
        report.ratio("lora_peak_memory_vs_full_finetune", Samples([lora / full]),
                     "runyard full fine-tune, same model and batches", "<=", 0.8,
                     {"full_bytes": full, "lora_bytes": lora})
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
