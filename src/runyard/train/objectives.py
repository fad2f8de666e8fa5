"""The training objectives as small functions of logits and labels (trl / torchtune style), each
checked against a hand computation in tests/train/test_objectives.py.

- next token (pretrain) and supervised fine-tuning share one loss (runyard.model.compute.token_loss_sum, which
  the planner's calibration runs too): the cross-entropy summed over the
  positions whose label is not `IGNORE_INDEX`. SFT data marks the prompt's positions (and padding) with
  the ignore index in its labels, so the loss sees only the assistant's tokens; the masking lives in the
  labels, never in the loop. The loop divides the sum by the supervised tokens of the whole global batch.
- DPO (Rafailov et al. 2023, trl's sigmoid formulation): for each (chosen, rejected) pair,
  loss = -log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r))), where pi_* and ref_* are the summed
  log-probabilities of the response tokens under the policy and the frozen reference; the implicit
  rewards are beta * (pi - ref).
- label smoothing (images, model.cnn.label_smoothing; Szegedy et al. 2016): the target is 1 - eps on the
  label plus eps / K on each of the K classes, so per sample loss = (1 - eps) * -log p_y + eps * mean_k -log p_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runyard.data.samples import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "DPOTerms", "dpo_loss", "sequence_logprobs", "smoothed_loss_sum", "supervised_tokens"]


def supervised_tokens(labels: torch.Tensor) -> int:
    """Positions the loss covers (labels other than IGNORE_INDEX)."""
    return int((labels != IGNORE_INDEX).sum())


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per sequence, the summed log-probability of its labelled tokens: [B]. logits [B, T, V] predict
    labels [B, T]; ignored positions contribute 0."""
    mask = labels != IGNORE_INDEX
    safe = labels.masked_fill(~mask, 0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(dim=-1)


@dataclass(frozen=True)
class DPOTerms:
    """Per pair: the loss and the implicit rewards of the chosen and rejected responses."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> DPOTerms:
    """trl's sigmoid DPO loss from summed response log-probabilities (each [pairs]); the reference's are
    constants (no gradient flows into them)."""
    ref_chosen, ref_rejected = ref_chosen.detach(), ref_rejected.detach()
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    return DPOTerms(
        losses=-F.logsigmoid(beta * logits),
        chosen_rewards=beta * (policy_chosen - ref_chosen).detach(),
        rejected_rewards=beta * (policy_rejected - ref_rejected).detach(),
    )


def smoothed_loss_sum(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Label-smoothed cross-entropy summed over the samples (fp32): logits [B, K], labels [B]."""
    return F.cross_entropy(logits.float(), labels, label_smoothing=smoothing, reduction="sum")
