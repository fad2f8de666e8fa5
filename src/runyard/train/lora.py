"""LoRA (Hu et al. 2021) applied from outside the model, as parallelism is: named projections get a
low-rank update y = W x + (alpha / r) B A dropout(x), the base weights stay frozen, and the update is
merged into W for export.

Why not peft: peft wraps whole `nn.Linear` modules by name, but runyard's decoder fuses q, k and v into
one projection (`attn.wqkv`) and gate and up into another (`ffn.w_gate_up`); one adapter over a fused
matrix is a different model from peft's three adapters on a Llama's separate q/k/v projections (rank r
each, so up to 3r together), and the merged export would not mean what the same spec means elsewhere.
peft also renames every wrapped module (`base_layer`), which moves the parameter names that checkpoints,
FSDP units and the export mapping use, and it would bring transformers and accelerate into the trainer's
core dependencies. Here each named projection is a row slice of a fused matrix with its own A and B, held
by a small module attached to the linear layer (`<linear>.lora`) and added by a forward hook: the
model's own names do not move, and targets mean what they mean in Hugging Face Llama models.

Only adapters train: every base parameter has requires_grad False, and `AdapterSet` (the adapters alone,
named by their place in the model) is what the optimizer steps and what checkpoints save, with the
sha256 of the frozen base beside them so a resume onto other base weights is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from runyard.errors import RunyardError
from runyard.spec.finetune import LoRASpec

# Adapters (and so their AdamW state) are fp32 whatever the base's dtype: a bf16 base trains fp32 adapters
# (bf16's 8-bit mantissa would round away B's small early updates); autocast still runs their matmuls in bf16.
ADAPTER_DTYPE = torch.float32


class LoRAError(RunyardError):
    """LoRA cannot be applied as asked (an unknown target, a family without projections, FSDP)."""


def decoder_targets(model: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
    """For runyard's decoder: each Hugging Face projection name -> (linear's path, first row, end row)
    of every block. q/k/v are row slices of `attn.wqkv`, gate/up of `ffn.w_gate_up`."""
    cfg = model.cfg
    q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    per_block = {
        "q_proj": ("attn.wqkv", 0, q),
        "k_proj": ("attn.wqkv", q, q + kv),
        "v_proj": ("attn.wqkv", q + kv, q + 2 * kv),
        "o_proj": ("attn.wo", 0, cfg.d_model),
        "gate_proj": ("ffn.w_gate_up", 0, f),
        "up_proj": ("ffn.w_gate_up", f, 2 * f),
        "down_proj": ("ffn.w_down", 0, cfg.d_model),
    }
    return {name: [(f"blocks.{i}.{path}", lo, hi) for i in range(cfg.n_layers)]
            for name, (path, lo, hi) in per_block.items()}


class LoRAModule(nn.Module):
    """The adapters of one linear layer: for each named row slice [lo, hi), A [r, in] and B [hi-lo, r]."""

    def __init__(self, in_features: int, out_features: int, slices: list[tuple[str, int, int]], rank: int,
                 alpha: float, dropout: float, generator: torch.Generator):
        super().__init__()
        self.out_features, self.scale = out_features, alpha / rank
        self.slices = sorted(slices, key=lambda s: s[1])
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform(a=sqrt(5)), as peft and nn.Linear do
        for name, lo, hi in self.slices:
            self.a[name] = nn.Parameter(torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator))
            self.b[name] = nn.Parameter(torch.zeros(hi - lo, rank))  # the update starts at zero
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to the layer's output for input x (zeros outside the slices)."""
        h = self.dropout(x)
        pieces, at = [], 0
        for name, lo, hi in self.slices:
            if lo > at:
                pieces.append(x.new_zeros(*x.shape[:-1], lo - at))
            pieces.append((h @ self.a[name].t()) @ self.b[name].t() * self.scale)
            at = hi
        if at < self.out_features:
            pieces.append(x.new_zeros(*x.shape[:-1], self.out_features - at))
        return torch.cat(pieces, dim=-1)

    def weight_delta(self) -> torch.Tensor:
        """The update as a matrix [out, in]: what merging adds to the base weight."""
        full = torch.zeros(self.out_features, next(iter(self.a.values())).shape[1],
                           dtype=self.a[self.slices[0][0]].dtype, device=self.a[self.slices[0][0]].device)
        for name, lo, hi in self.slices:
            full[lo:hi] = (self.b[name] @ self.a[name]) * self.scale
        return full


def _add_delta(module: nn.Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    if not module.lora.enabled:
        return output
    lora = module.lora
    return output + lora.delta(inputs[0].to(lora.b[lora.slices[0][0]].dtype)).to(output.dtype)


class AdapterSet(nn.Module):
    """The adapters alone, keyed by their linear layer's path ('.' as '/'): what the optimizer steps and
    checkpoints save. The modules are shared with the model (the same parameters)."""

    def __init__(self, modules: dict[str, LoRAModule], base_sha256: str):
        super().__init__()
        self.adapters = nn.ModuleDict({path.replace(".", "/"): m for path, m in modules.items()})
        self.base_sha256 = base_sha256

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def base_sha256(model: nn.Module) -> str:
    """sha256 over the model's tensors (name, dtype, shape, bytes) in name order: the frozen base."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if ".lora." in name:
            continue
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def apply_lora(model: nn.Module, spec: LoRASpec, seed: int) -> AdapterSet:
    """Freeze every parameter of `model`, attach adapters to the spec's targets, and return them.
    A's initialisation is drawn from `seed` alone (the training RNG is not touched)."""
    if not hasattr(model, "cfg") or not hasattr(model, "blocks"):
        raise LoRAError(f"LoRA knows the decoder's projections; {type(model).__name__} has none it can name")
    base = base_sha256(model)
    targets = decoder_targets(model)
    by_linear: dict[str, list[tuple[str, int, int]]] = {}
    for name in spec.targets:
        for path, lo, hi in targets[name]:
            by_linear.setdefault(path, []).append((name, lo, hi))
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    modules = {}
    for path in sorted(by_linear, key=lambda p: [int(x) if x.isdigit() else x for x in p.split(".")]):
        linear = model.get_submodule(path)
        lora = LoRAModule(linear.in_features, linear.out_features, by_linear[path], spec.rank, spec.alpha,
                          spec.dropout, generator).to(device=linear.weight.device, dtype=ADAPTER_DTYPE)
        linear.add_module("lora", lora)
        linear.register_forward_hook(_add_delta)
        modules[path] = lora
    return AdapterSet(modules, base)


def attach_trained_adapters(model: nn.Module, spec: LoRASpec, seed: int, weights: dict[str, torch.Tensor],
                            trained_on: str | None, origin: str) -> AdapterSet:
    """Attach adapters to `model` (its base) and load trained adapter weights into them; LoRAError when
    the adapters were trained on another base (`trained_on`: the sha256 their checkpoint recorded)."""
    adapters = apply_lora(model, spec, seed)
    if trained_on != adapters.base_sha256:
        raise LoRAError(f"{origin}: adapters trained on base {trained_on}, this base is {adapters.base_sha256}")
    adapters.load_state_dict(weights)
    return adapters


def lora_modules(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(path, linear) of every linear layer of `model` that carries adapters."""
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and isinstance(getattr(module, "lora", None), LoRAModule):
            yield path, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model's forward (the adapters switched off): DPO's frozen reference without a copy."""
    modules = [linear.lora for _, linear in lora_modules(model)]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.enabled = True


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with every adapter merged into its base weight (W + (alpha/r) B A) and the
    adapter tensors left out: the weights a plain model of the same config loads."""
    state = {k: v for k, v in model.state_dict().items() if ".lora." not in k}
    for path, linear in lora_modules(model):
        key = f"{path}.weight"
        state[key] = (linear.weight + linear.lora.weight_delta().to(linear.weight.dtype)).detach().clone()
    return state
