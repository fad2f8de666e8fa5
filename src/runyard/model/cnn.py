"""A small convolutional network for image classification (family `cnn`), trained by runyard's loop.

Blocks of convolution (padding keeps the size), batch norm, ReLU and 2x2 max pooling (while the image is
larger than 1 pixel), then global average pooling, a hidden layer, dropout and the classifier. The
training split's per-channel mean and std are part of the config and applied inside `forward`, so the
model takes pixels in [0, 1] as the data stage and a client give them. Built from torch.nn alone
(torchvision's CPU wheel does not install beside this torch without a CUDA build).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from runyard.model.registry import ExportError, ModelFamily, Sizing, register
from runyard.spec.predictive import CnnSpec

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class CnnConfig:
    in_channels: int
    height: int
    width: int
    n_classes: int
    channels: tuple[int, ...]
    kernel_size: int
    hidden: int
    dropout: float
    batch_norm: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("in_channels", "height", "width", "n_classes", "kernel_size", "hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"cnn config {name} must be a positive integer, got {value!r}")
        if self.n_classes < 2:
            raise ValueError(f"cnn config n_classes must be at least 2, got {self.n_classes}")
        if not self.channels or any(c < 1 for c in self.channels):
            raise ValueError(f"cnn config channels must be positive integers, got {self.channels!r}")
        if len(self.mean) != self.in_channels or len(self.std) != self.in_channels:
            raise ValueError("cnn config mean and std need one value per input channel")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CnnConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a cnn config is a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(data) - names), sorted(names - set(data))
        if unknown or missing:
            raise ValueError(f"cnn config: unknown keys {unknown}, missing keys {missing}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def block_sizes(self) -> list[tuple[int, int, int, int]]:
        """(in channels, out channels, height, width at the convolution) of each block."""
        out, c, h, w = [], self.in_channels, self.height, self.width
        for c_out in self.channels:
            out.append((c, c_out, h, w))
            c = c_out
            if min(h, w) > 1:
                h, w = h // 2, w // 2
        return out


class SmallCNN(nn.Module):
    def __init__(self, cfg: CnnConfig):
        super().__init__()
        self.cfg = cfg
        # Constants of the data, not learned: kept out of the state dict, rebuilt from the config.
        self.register_buffer("pixel_mean", torch.tensor(cfg.mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(cfg.std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        blocks = []
        for c_in, c_out, h, w in cfg.block_sizes():
            layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, cfg.kernel_size, padding=cfg.kernel_size // 2,
                                                 bias=not cfg.batch_norm)]
            if cfg.batch_norm:
                layers.append(nn.BatchNorm2d(c_out))
            layers.append(nn.ReLU())
            if min(h, w) > 1:
                layers.append(nn.MaxPool2d(2))
            blocks.append(nn.Sequential(*layers))
        self.blocks = nn.ModuleList(blocks)
        self.hidden = nn.Linear(cfg.channels[-1], cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(cfg.hidden, cfg.n_classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Class logits [batch, n_classes] of pixels [batch, C, H, W] in [0, 1]."""
        x = (pixels - self.pixel_mean) / self.pixel_std
        for block in self.blocks:
            x = block(x)
        x = x.mean(dim=(2, 3))  # global average pooling
        return self.head(self.dropout(F.relu(self.hidden(x))))


def flops_per_sample(cfg: CnnConfig) -> float:
    """Training FLOPs per image: 3 x the forward's multiply-adds x 2 (backward costs twice the forward)."""
    forward = 0
    for c_in, c_out, h, w in cfg.block_sizes():
        forward += 2 * cfg.kernel_size**2 * c_in * c_out * h * w
    forward += 2 * cfg.channels[-1] * cfg.hidden + 2 * cfg.hidden * cfg.n_classes
    return 3.0 * forward


def activation_bytes(cfg: CnnConfig, micro_batch: int, bytes_per_value: int = 4) -> int:
    """Activations kept for backward: per block the convolution, norm and ReLU outputs (3 maps of the
    block's size) and the pooled map, plus the input and the small head."""
    values = cfg.in_channels * cfg.height * cfg.width
    for _c_in, c_out, h, w in cfg.block_sizes():
        values += 3 * c_out * h * w + c_out * max(1, h // 2) * max(1, w // 2)
    values += 2 * cfg.hidden + cfg.n_classes
    return values * micro_batch * bytes_per_value


class CnnFamily(ModelFamily):
    name = "cnn"
    tasks = ("image_classification",)
    why_recommended = "a convolutional network learns local patterns a flat model cannot"

    def config_from_spec(self, spec: Any, *, shape: tuple[int, int, int] | None = None, n_classes: int | None = None,
                         mean: list[float] | None = None, std: list[float] | None = None, **data_facts: Any) -> CnnConfig:
        if shape is None or n_classes is None:
            raise ValueError("the cnn's config needs the prepared images' shape and n_classes")
        section = spec.cnn or CnnSpec()
        channels = shape[0]
        return CnnConfig(
            in_channels=channels, height=shape[1], width=shape[2], n_classes=n_classes,
            channels=tuple(section.channels), kernel_size=section.kernel_size, hidden=section.hidden,
            dropout=section.dropout, batch_norm=section.batch_norm,
            mean=tuple(mean or [0.0] * channels), std=tuple(std or [1.0] * channels),
        )

    def config_from_dict(self, data: dict[str, Any]) -> CnnConfig:
        return CnnConfig.from_dict(data)

    def sizing(self, config: CnnConfig, micro_batch: int = 1) -> Sizing:
        with torch.device("meta"):
            model = SmallCNN(config)
        parameters = sum(p.numel() for p in model.parameters())
        return Sizing(parameters=parameters, non_embedding_parameters=parameters,
                      flops_per_unit=flops_per_sample(config), unit="sample",
                      activation_bytes=activation_bytes(config, micro_batch))

    def build(self, config: CnnConfig) -> SmallCNN:
        return SmallCNN(config)

    def synthetic_batch(self, config: CnnConfig, micro_batch: int,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random pixels in [0, 1] of the prepared images' shape and random labels: `plan` times real
        training steps on them (a step's cost depends on the shapes, not the pixels)."""
        pixels = torch.rand((micro_batch, config.in_channels, config.height, config.width), generator=generator)
        return pixels, torch.randint(0, config.n_classes, (micro_batch,), generator=generator)

    def optimizer_groups(self, model: nn.Module, optim: Any) -> list[dict[str, Any]]:
        """Convolution and linear weights decay; biases and batch-norm weights only if the spec says so."""
        decay, no_decay = [], []
        for p in model.parameters():
            (decay if p.ndim >= 2 or optim.decay_norms_and_biases else no_decay).append(p)
        return [{"name": "decay", "params": decay, "weight_decay": optim.weight_decay},
                {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def export_files(self, model: nn.Module, config: CnnConfig, directory: Path) -> list[str]:
        if model.cfg != config:
            raise ExportError(f"the model was built with {model.cfg}, not the config given to export: {config}")
        weights = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return [WEIGHTS_FILE]

    def load_files(self, directory: Path, config: CnnConfig, device: str | torch.device = "cpu") -> SmallCNN:
        path = directory / WEIGHTS_FILE
        if not path.is_file():
            raise ExportError(f"{path} is missing from the export")
        try:
            weights = load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ExportError(f"{path} cannot be read: {exc}") from None
        with torch.random.fork_rng(devices=[]):
            model = SmallCNN(config)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        if set(expected) != set(weights):
            raise ExportError(f"{path} does not match its config: missing {sorted(set(expected) - set(weights))}, "
                              f"unexpected {sorted(set(weights) - set(expected))}")
        for name, shape in expected.items():
            if weights[name].shape != shape:
                raise ExportError(f"{path}: tensor {name} has shape {tuple(weights[name].shape)}, config implies {tuple(shape)}")
        model.load_state_dict(weights)
        return model.to(device).eval()


CNN = register(CnnFamily())
