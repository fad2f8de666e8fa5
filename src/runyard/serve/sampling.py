"""Per-request sampling over a batch of logits.

Each row has its own `SamplingParams` and its own `torch.Generator` (seeded from the request's seed, or
from fresh OS entropy when the request gives none). A row's draw uses only its own generator and its
own logits, one uniform number per token, so a seeded request samples the same tokens alone or inside
any batch: batching changes which rows sit beside it, never what it draws.

Order of operations (the usual one): temperature (0 means greedy), then top-k, then top-p (nucleus),
then inverse-CDF sampling with the row's uniform draw. Log-probabilities reported to clients are those
of the model's own distribution (log-softmax of the raw logits), as OpenAI's API reports them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from runyard.spec.seeds import derive_seed

MAX_LOGPROBS = 20  # top alternatives a client may ask for per token (OpenAI's chat limit)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and the k most likely
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one sequence: seeded when the request has a seed, else from OS entropy."""
    return torch.Generator(device="cpu").manual_seed(seed if seed is not None else secrets.randbits(63))


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed` (choice 0 keeps the request's own seed, so a
    request with n=1 and one with n=3 share their first completion)."""
    return seed if index == 0 else derive_seed(seed, "choice", index)


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the most likely alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits [vocab] after temperature, top-k and top-p (fp32; excluded tokens at -inf)."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if params.top_k is not None and params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


def _inverse_cdf(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [n, vocab], row i from one uniform draw of generators[i]."""
    cdf = probs.cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g) for g in generators]) * cdf[:, -1]
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_max(probs.shape[-1] - 1)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token id from one row's logits [vocab] with that row's generator."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filtered_logits(logits, params), dim=-1)
    return int(_inverse_cdf(probs[None], [generator])[0])


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Next token of every row of `logits` [B, vocab] (on any device), each by its own params and
    generator; with logprobs for the rows that asked for them. Rows with plain temperature sampling
    are done together (the same per-row arithmetic as one row alone); top-k / top-p rows one by one."""
    if all(p.greedy and p.logprobs is None for p in params):  # the common case, without the per-row work
        return logits.argmax(-1).tolist(), [None] * len(params)
    logits = logits.float().cpu()
    tokens = torch.empty(len(params), dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    plain = [i for i, p in enumerate(params) if not p.greedy and p.top_k is None and p.top_p >= 1.0]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(-1)
    if plain:
        temps = torch.tensor([params[i].temperature for i in plain], dtype=torch.float32)
        probs = torch.softmax(logits[plain] / temps[:, None], dim=-1)
        tokens[plain] = _inverse_cdf(probs, [generators[i] for i in plain])
    done = set(greedy) | set(plain)
    for i, p in enumerate(params):
        if i not in done:
            tokens[i] = sample_row(logits[i], p, generators[i])
    chosen = tokens.tolist()
    out: list[TokenLogprobs | None] = [None] * len(chosen)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        logp = torch.log_softmax(logits[wanted], dim=-1)
        k = max(params[i].logprobs or 0 for i in wanted)
        top_vals, top_ids = torch.topk(logp, k, dim=-1) if k else (None, None)
        for row, i in enumerate(wanted):
            n = params[i].logprobs or 0
            top = ()
            if n:
                top = tuple(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist(), strict=True))
            out[i] = TokenLogprobs(chosen[i], float(logp[row, chosen[i]]), top)
    return chosen, out
