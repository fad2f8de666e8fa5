"""What one optimizer step computes for each stage kind: pretrain (next token over the token stream),
sft (the loss on assistant tokens of padded conversations) and dpo (preference pairs against a frozen
reference). The loop (loop.py) stays one story; an objective gives it batches, the count each loss is
normalised by, the summed loss of a micro-batch, and the held-out evaluation.

Normalisation: the loop sums each micro-batch's loss and divides by the global count of the step (tokens
for pretrain, supervised tokens for sft, pairs for dpo) over every micro-batch and process, so
accumulation and several processes give the gradient of one large batch. Pretrain and dpo know that
count in advance; sft sums it over the ranks as a tensor on the device (one small all-reduce per step
that the host never waits for).

Nothing here reads a tensor back to the host: a step's statistics (`step_stats`, a float64 vector on the
device) are summed over the ranks and read back by the loop only when it logs, which turns them into the
row's metrics (`step_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from runyard.data.image_loader import ImageLoader
from runyard.data.instruct import PreparedInstruct
from runyard.data.loader import EvalSample, TokenLoader
from runyard.data.samples import Batch, SampleLoader, eval_batches
from runyard.model.compute import token_loss_sum
from runyard.train import parallel
from runyard.train.finetune_metrics import dpo_metrics, pair_logprobs, response_loss
from runyard.train.lora import adapters_disabled
from runyard.train.objectives import dpo_loss, sequence_logprobs, smoothed_loss_sum

Autocast = Callable[[], AbstractContextManager]
NO_SUPERVISED = "a step's global batch holds no supervised token (the data stage drops such samples)"


class PretrainObjective:
    """Next-token prediction on fixed-length windows of the token stream; for images, the label of each
    image (the family's `unit` names what one target is: a token, or a sample)."""

    kind = "pretrain"

    def __init__(self, loader: TokenLoader | ImageLoader, heldout: EvalSample, unit: str = "token",
                 label_smoothing: float = 0.0):
        self.loader, self.heldout, self.unit, self.label_smoothing = loader, heldout, unit, label_smoothing

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.next_batch()

    def inputs_targets(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch as the (inputs, targets) a pipeline schedule runs."""
        return batch

    def global_counts(self, batches: list, ctx: parallel.DistContext) -> tuple[float, float]:
        """(loss normaliser, input tokens) of the step over every process (each rank reads as many)."""
        tokens = float(sum(y.numel() for _, y in batches) * ctx.world_size)
        return tokens, tokens

    def loss_sum(self, module: torch.nn.Module, batch, device: torch.device, autocast: Autocast) -> torch.Tensor:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        with autocast():
            logits = module(x)
        if self.label_smoothing:  # images (model.cnn.label_smoothing); the held-out loss stays plain
            return smoothed_loss_sum(logits, y, self.label_smoothing)
        return token_loss_sum(logits, y)

    def step_stats(self, device: torch.device) -> torch.Tensor:
        """This rank's statistics of the step just taken (summed over ranks when logged); resets them."""
        return torch.zeros(0, dtype=torch.float64, device=device)

    def step_metrics(self, sums: list[float]) -> dict[str, float]:
        """A logged step's metrics from its `step_stats` summed over the ranks."""
        return {}

    def evaluate(self, module: torch.nn.Module, device: torch.device, autocast: Autocast,
                 evaluate_loss: Callable) -> dict[str, Any]:
        return {"heldout_loss": evaluate_loss(module, self.heldout.batches),
                f"heldout_{self.unit}s": self.heldout.tokens, "heldout_documents": self.heldout.documents}


class SFTObjective:
    """Cross-entropy on the assistant's tokens of padded conversations (labels mask everything else)."""

    kind = "sft"

    def __init__(self, loader: SampleLoader, heldout: list[Batch]):
        self.loader, self.heldout = loader, heldout
        self._padding = self._positions = 0.0

    def next_batch(self) -> Batch:
        return self.loader.next_batch()

    def global_counts(self, batches: list[Batch], ctx: parallel.DistContext):
        """(supervised tokens, input tokens) of the step over every process: host numbers in one process,
        device tensors summed over the ranks in several (the loss scale then stays on the device)."""
        local = [float(sum(b.supervised for b in batches)), float(sum(b.real_tokens for b in batches))]
        if not ctx.distributed:
            if local[0] == 0:
                raise RuntimeError(NO_SUPERVISED)
            return local[0], local[1]
        counts = parallel.all_reduce_sum_tensor(parallel.device_values(local, ctx), ctx)
        torch._assert_async(counts[0] > 0, NO_SUPERVISED)
        return counts[0], counts[1]

    def inputs_targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch as (inputs, labels), the labels masking all but the responses; counts its padding."""
        self._padding += batch.inputs.numel() - batch.real_tokens
        self._positions += batch.inputs.numel()
        return batch.inputs, batch.labels

    def loss_sum(self, module: torch.nn.Module, batch: Batch, device: torch.device, autocast: Autocast) -> torch.Tensor:
        inputs, labels = self.inputs_targets(batch)
        with autocast():
            logits = module(inputs.to(device, non_blocking=True))
        return token_loss_sum(logits, labels.to(device, non_blocking=True))

    def step_stats(self, device: torch.device) -> torch.Tensor:
        stats = torch.tensor([self._padding, self._positions], dtype=torch.float64).to(device, non_blocking=True)
        self._padding = self._positions = 0.0
        return stats

    def step_metrics(self, sums: list[float]) -> dict[str, float]:
        padding, positions = sums
        return {"padding_fraction": padding / max(positions, 1.0)}

    def evaluate(self, module: torch.nn.Module, device: torch.device, autocast: Autocast,
                 evaluate_loss: Callable | None) -> dict[str, Any]:
        """The held-out response loss: through the loop's `evaluate_loss` while training (which runs a
        pipeline's stages together), on a whole model for the before/after record (`None`)."""
        if evaluate_loss is None:
            loss, tokens = response_loss(module, self.heldout, device, autocast)
        else:
            loss = evaluate_loss(module, [(b.inputs, b.labels) for b in self.heldout])
            tokens = sum(b.supervised for b in self.heldout)
        return {"heldout_loss": loss, "heldout_response_tokens": tokens}


class DPOObjective:
    """The DPO loss of (chosen, rejected) pairs: both responses in one forward, the reference's
    log-probabilities from the stage's initial weights (adapters switched off, or a frozen copy)."""

    kind = "dpo"

    def __init__(self, loader: SampleLoader, heldout: list[Batch], beta: float, reference: Callable):
        self.loader, self.heldout, self.beta, self.reference = loader, heldout, beta, reference
        self._heldout_reference: list | None = None
        self._stats: list = [0.0, 0.0, 0.0]  # pairs, pairs ranked right, summed margin (the last two on the device)

    def next_batch(self) -> Batch:
        return self.loader.next_batch()

    def global_counts(self, batches: list[Batch], ctx: parallel.DistContext):
        tokens: Any = float(sum(b.real_tokens for b in batches))
        if ctx.distributed:  # for throughput only: summed on the device, read when logged
            tokens = parallel.all_reduce_sum_tensor(parallel.device_values([tokens], ctx), ctx)[0]
        return float(sum(b.pairs for b in batches) * ctx.world_size), tokens  # each rank reads as many

    def loss_sum(self, module: torch.nn.Module, batch: Batch, device: torch.device, autocast: Autocast) -> torch.Tensor:
        ref_c, ref_r = self.reference(batch, device, autocast)
        with autocast():
            logits = module(batch.inputs.to(device, non_blocking=True))
        logps = sequence_logprobs(logits, batch.labels.to(device, non_blocking=True))
        terms = dpo_loss(logps[: batch.pairs], logps[batch.pairs :], ref_c, ref_r, self.beta)
        margins = terms.margins.detach()
        self._stats[0] += batch.pairs
        self._stats[1] = (margins > 0).sum().double() + self._stats[1]
        self._stats[2] = margins.sum().double() + self._stats[2]
        return terms.losses.sum()

    def step_stats(self, device: torch.device) -> torch.Tensor:
        stats = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in self._stats])
        self._stats = [0.0, 0.0, 0.0]
        return stats

    def step_metrics(self, sums: list[float]) -> dict[str, float]:
        pairs, right, margin = sums
        return {"reward_accuracy": right / max(pairs, 1.0), "reward_margin": margin / max(pairs, 1.0)}

    def evaluate(self, module: torch.nn.Module, device: torch.device, autocast: Autocast,
                 evaluate_loss: Callable) -> dict[str, Any]:
        return dpo_metrics(module, self.heldout_reference(device, autocast), self.heldout, self.beta, device,
                           autocast)

    def heldout_reference(self, device: torch.device, autocast: Autocast) -> list:
        """The reference's log-probabilities of the held-out pairs, scored once (the reference never
        changes). Under FSDP the first call is collective: the loop makes it on every rank before rank 0
        evaluates the initial weights alone."""
        if self._heldout_reference is None:
            self._heldout_reference = [self.reference(b, device, autocast) for b in self.heldout]
        return self._heldout_reference


def dpo_reference(reference: torch.nn.Module, uses_lora: bool) -> Callable:
    """The frozen reference's log-probabilities of a batch: `reference` is the model itself when the stage
    trains LoRA (the base under the adapters, switched off: no second copy), else a frozen copy of the stage's
    initial weights (train/layout.py `frozen_copy`, sharded like the policy under FSDP: then every rank
    scores its batch together). Always in eval mode (no dropout)."""

    def logprobs(batch: Batch, device: torch.device, autocast: Autocast) -> tuple[torch.Tensor, torch.Tensor]:
        was_training = reference.training
        reference.eval()
        try:
            if uses_lora:
                with adapters_disabled(reference):
                    return pair_logprobs(reference, batch, device, autocast)
            return pair_logprobs(reference, batch, device, autocast)
        finally:
            reference.train(was_training)

    return logprobs


def instruct_objective(kind: str, instruct: PreparedInstruct, batch_size: int, eval_samples: int, seed: int,
                       eval_seed: int, grouping: int, ctx: parallel.DistContext, beta: float,
                       reference: Callable | None) -> SFTObjective | DPOObjective:
    """The sft or dpo objective over a prepared instruction dataset."""
    loader = SampleLoader(instruct.stores("train"), batch_size, seed, instruct.pad_id, rank=ctx.rank,
                          world_size=ctx.world_size, length_grouping=grouping)
    heldout, _ids = eval_batches(instruct.stores("heldout"), batch_size, eval_samples, eval_seed, instruct.pad_id)
    if kind == "sft":
        return SFTObjective(loader, heldout)
    assert reference is not None
    return DPOObjective(loader, heldout, beta, reference)
