"""One decoding sequence's steps as a compiled graph, on CPU: the serving engine's `compile` option there.

With one sequence decoding and no prompt in the step, an eager step is ~900 small operator calls around 17
one-row matrix products, and the calls cost more than the products (benchmarks/results/serve_profile.md).
Compiled whole by inductor's C++ backend, the step is a few fused loops (norms, rotary, SwiGLU) around
GEMM kernels for one row, with a C++ wrapper instead of a Python one between them
(benchmarks/serve_throughput.py records one client's time per output token against llama.cpp's).

- The weights are frozen into the graph (inductor's `freezing`): constants it packs once into the layout
  its GEMM templates read, instead of inputs read as they lie. That packed copy is memory the compiled
  step holds beside the model's own weights, and it is why the served weights must not change in place
  (the engine never changes them).
- One graph serves every step: the key count is a dynamic size (`DecodeRow`'s mask), so the graph is
  compiled once, when the engine is built (seconds to a minute: inductor times its GEMM kernels), and
  attends over exactly the sequence's keys. Steps with several sequences or with prompts stay eager, as do a sequence's
  first position and the pool's last (outside the dynamic size's range).
- Fused kernels round differently from eager ones, so a near-tie can pick another greedy token.
- Compiling tries inductor's C++ GEMM templates alone first (autotuning against the library GEMM picked
  the slower one now and then), then with the library GEMM beside them. If both fail (no C++ compiler
  on the machine), the step runs eager from then on, with one warning.
"""

from __future__ import annotations

import logging

import torch

from runyard.model.kv_cache import DecodeRow, KVPool

log = logging.getLogger(__name__)

# inductor's options for a one-row step on CPU, in the order tried: its C++ wrapper (no Python between
# kernels) and its GEMM templates, which read the frozen weights prepacked.
_CPU_OPTION_SETS = (
    {"cpp_wrapper": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
    {"cpp_wrapper": True, "max_autotune": True},
)


class DecodeGraph:
    """Logits for one sequence's next position from a compiled graph (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, pool: KVPool):
        self.model, self.pool = model, pool
        self._zeros = torch.zeros(1, 1, 1, pool.max_len, dtype=pool.dtype, device=pool.device)
        self._tries = [torch.compile(self._logits, dynamic=False, options=opts) for opts in _CPU_OPTION_SETS]
        self._compiled = False  # whether the current try has compiled its graph
        self.failed: str | None = None  # why compiled decoding is off
        self.steps = 0  # steps it served (tests and the benchmarks read it)
        # Compiled now rather than on the first request, so a server listens once its step is ready: a step
        # at position 1 of slot 0, which no sequence holds yet.
        with torch.inference_mode():
            self.logits(0, 1)
        self.steps = 0

    def _logits(self, view: DecodeRow, token: torch.Tensor) -> torch.Tensor:
        return self.model(token[None], kv_cache=view, positions=view.positions[None],
                          logits_at=torch.zeros(1, dtype=torch.long, device=token.device))

    def _call(self, view: DecodeRow, token: torch.Tensor) -> torch.Tensor:
        """The current try's graph; its first call compiles it, with the weights frozen."""
        if self._compiled:
            return self._tries[0](view, token)
        # Deferred: importing inductor takes a second, which an engine that never compiles need not pay.
        import torch._inductor.config as inductor_config

        # Dynamo reads `freezing` while it traces, not from torch.compile's options, so it is set around the
        # compiling call (a global setting: a model another thread compiles meanwhile is frozen too).
        with inductor_config.patch(freezing=True):
            logits = self._tries[0](view, token)
        self._compiled = True
        return logits

    def logits(self, token: int, position: int) -> torch.Tensor | None:
        """[1, vocab] for `token` at `position` (its keys and values written to slot 0), or None when the
        caller must run the step eagerly (compiling failed, or the position is outside the graph's range)."""
        if self.failed is not None or not 0 < position < self.pool.max_len - 1:
            return None
        # Keys 2..max_len-1: Dynamo specialises sizes 0 and 1, and a slice of the whole pool is another graph.
        mask = self._zeros[..., : position + 1]
        torch._dynamo.mark_dynamic(mask, 3, min=2, max=self.pool.max_len - 1)
        view = DecodeRow(self.pool, position, mask)
        token_row = torch.tensor([token], device=self.pool.device)
        error = ""
        while self._tries:
            try:
                logits = self._call(view, token_row)
                break
            except Exception as exc:  # inductor's errors have no common base; any means: the next try
                error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                self._tries.pop(0)
                self._compiled = False
        else:
            self.failed = error
            log.warning("compiled decoding is off for this engine (%s); steps run eagerly", self.failed)
            return None
        self.steps += 1
        return logits
