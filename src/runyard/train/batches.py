"""What the training loop reads, for each kind of prepared data: the facts a model family's config needs,
the training loader, and the fixed held-out sample scored during training.

Text (the data stage's `PreparedData`): token windows of the model's context length, held-out from the
held-out split. Images (`PreparedImages`): pixel batches and labels, held-out from the validation split
(the test split is scored once, at the end). Both loaders share one contract (next_batch, state_dict,
load_state_dict, close), so the loop, its checkpoints and exact resume are the same for both. The image
recipe's training-only parts (model.cnn: augmentation in the loader, label smoothing in the loss) are
read here too.
"""

from __future__ import annotations

from typing import Any

from runyard.data.image_augment import Augment
from runyard.data.image_loader import ImageLoader, image_eval_sample
from runyard.data.image_prep import PreparedImages
from runyard.data.loader import EvalSample, TokenLoader, eval_sample
from runyard.data.pipeline import PreparedData
from runyard.spec.predictive import CnnSpec
from runyard.train.parallel import DistContext

HELDOUT_SPLIT = "validation"  # images: the split scored during training


def data_facts(prepared: PreparedData | PreparedImages) -> dict[str, Any]:
    """Keyword arguments for the family's `config_from_spec`."""
    if isinstance(prepared, PreparedImages):
        return {"shape": prepared.shape, "n_classes": prepared.n_classes, "mean": prepared.mean, "std": prepared.std}
    return {"vocab_size": prepared.vocab_size}


def _cnn(model_spec: Any) -> CnnSpec:
    return getattr(model_spec, "cnn", None) or CnnSpec()


def label_smoothing(prepared: PreparedData | PreparedImages, model_spec: Any) -> float:
    """The training loss's label smoothing: the CNN's (model.cnn.label_smoothing) for images, none for text."""
    return _cnn(model_spec).label_smoothing if isinstance(prepared, PreparedImages) else 0.0


def train_loader(prepared: PreparedData | PreparedImages, config: Any, batch_size: int, seed: int,
                 ctx: DistContext) -> TokenLoader | ImageLoader:
    if isinstance(prepared, PreparedImages):
        return ImageLoader(prepared, "train", batch_size, seed, rank=ctx.rank, world_size=ctx.world_size,
                           augment=Augment.from_spec(_cnn(config).augment))
    return TokenLoader(prepared.train_index, seq_len=config.context_length, batch_size=batch_size, seed=seed,
                       rank=ctx.rank, world_size=ctx.world_size)


def heldout_sample(prepared: PreparedData | PreparedImages, config: Any, batch_size: int, samples: int,
                   seed: int) -> EvalSample:
    """The same `samples` held-out sequences (or images) at every evaluation, drawn across the split."""
    if isinstance(prepared, PreparedImages):
        return image_eval_sample(prepared, HELDOUT_SPLIT, batch_size, samples, seed)
    return eval_sample(prepared.heldout_index, config.context_length, batch_size, samples, seed)
