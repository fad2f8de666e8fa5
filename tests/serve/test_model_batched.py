"""The model's serving paths (a KV slot pool, per-row positions, logits at one position) against the
plain forward, and the training path unchanged bit for bit by the serving changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runyard.model.kv_cache import KVCache, KVPool, PrefillChunk
from runyard.model.ops import rotary_qk
from runyard.model.transformer import ModelConfig, Transformer


def small_model(seed: int = 0, ctx: int = 48, kv_heads: int = 2, dropout: float = 0.0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, ffn_hidden=64,
                      context_length=ctx, dropout=dropout)
    return Transformer(cfg)


def reference_forward(model: Transformer, idx: torch.Tensor) -> torch.Tensor:
    """The training forward exactly as it was written before the serving changes (attention with
    is_causal, rotary tables sliced from position 0), using the model's own parameters."""
    T = idx.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.drop(model.tok_emb(idx))
    for block in model.blocks:
        attn = block.attn
        h = block.attn_norm(x)
        B = h.shape[0]
        H, KV = attn.n_heads, attn.n_kv_heads
        qkv = attn.wqkv(h).view(B, T, H + 2 * KV, attn.head_dim)
        qk, v = qkv.split([H + KV, KV], dim=2)
        q, k = rotary_qk(qk, cos, sin, H)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=attn.dropout if attn.training else 0.0, is_causal=True,
            enable_gqa=KV != H,
        )
        x = x + block.drop(attn.wo(y.transpose(1, 2).reshape(B, T, H * attn.head_dim)))
        x = x + block.drop(block.ffn(block.ffn_norm(x)))
    return model.lm_head(model.norm(x))


def test_training_forward_and_backward_are_bitwise_the_reference():
    model = small_model(dropout=0.1).train()
    idx = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(2))
    results = []
    for forward in (lambda m, x: m(x), reference_forward):
        model.zero_grad()
        torch.manual_seed(5)  # the same dropout masks for both
        loss = F.cross_entropy(forward(model, idx).flatten(0, 1), targets.flatten())
        loss.backward()
        results.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a), "a gradient differs from the reference"


def test_contiguous_cache_decoding_is_unchanged():
    """The single-sequence KVCache path (runyard generate) gives the full forward's logits."""
    model = small_model().eval()
    seq = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        full = model(seq)
        chunks = [model(seq[:, :8], kv_cache=cache, start_pos=0), model(seq[:, 8:15], kv_cache=cache, start_pos=8)]
        chunks += [model(seq[:, t : t + 1], kv_cache=cache, start_pos=t) for t in range(15, 20)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-5, atol=1e-5)
    assert isinstance(cache, KVCache)


def run_step(model, pool, decoding: list[list[int]], chunks: list[tuple[int, list[int], int]]):
    """One engine-style step: the last token of each sequence in `decoding` (slot i holds all of
    decoding[i] but its last token), then prompt chunks (slot, whole prompt, start); returns the logits
    of every decode row and of every chunk's last token."""
    tokens = [s[-1] for s in decoding]
    kv_chunks, rows = [], list(range(len(decoding)))
    for slot, prompt, start in chunks:
        tokens += prompt[start:]
        kv_chunks.append(PrefillChunk(slot, start, len(prompt) - start))
        rows.append(len(tokens) - 1)
    view = pool.step([len(s) - 1 for s in decoding], kv_chunks)
    return model(torch.tensor([tokens]), kv_cache=view, positions=view.positions[None], logits_at=torch.tensor(rows))


def test_mixed_steps_of_decode_rows_and_prefill_chunks_equal_each_sequence_alone():
    """Decode rows at different positions and prompt chunks (whole, first part, continued) in one
    forward give each sequence's own logits, with grouped and ungrouped key/value heads."""
    for kv_heads in (2, 4):
        model = small_model(kv_heads=kv_heads).eval()
        pool = model.new_kv_pool(n_slots=5)
        assert isinstance(pool, KVPool) and pool.nbytes == 5 * KVPool.bytes_per_slot(2, kv_heads, 48, 8, torch.float32)
        prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
        with torch.no_grad():
            # Step 1: prompts 0 and 1 whole, prompt 2's first two tokens.
            logits = run_step(model, pool, [], [(0, prompts[0], 0), (1, prompts[1], 0), (2, prompts[2][:2], 0)])
            seqs = [list(prompts[0]), list(prompts[1])]
            checks = [(seqs[0], logits[0]), (seqs[1], logits[1]), (prompts[2][:2], logits[2])]
            for step in range(5):
                for i, (seq, got) in enumerate(checks):
                    alone = model(torch.tensor([seq]))[0, -1]
                    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5, msg=f"kv {kv_heads} step {step} row {i}")
                seqs = [s + [int(t)] for s, t in zip(seqs, logits[: len(seqs)].argmax(-1), strict=True)]
                chunks = []
                if step == 0:  # prompt 2 continues from position 2 and completes; prompt 3 starts
                    chunks = [(2, prompts[2], 2), (3, prompts[3], 0)]
                logits = run_step(model, pool, seqs, chunks)
                checks = [(s, logits[i]) for i, s in enumerate(seqs)]
                if step == 0:
                    checks += [(prompts[2], logits[2]), (prompts[3], logits[3])]
                    seqs += [list(prompts[2]), list(prompts[3])]  # their first tokens are appended next


def test_moving_a_slot_keeps_its_sequence():
    """Compaction: the last running sequence moved into a freed slot decodes as before."""
    model = small_model().eval()
    pool = model.new_kv_pool(n_slots=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    with torch.no_grad():
        run_step(model, pool, [], [(0, prompts[0], 0), (1, prompts[1], 0)])
        pool.move(1, 0, length=5)  # sequence 1 takes slot 0; slot 1 is free
        moved = run_step(model, pool, [prompts[1] + [9]], [])
        alone = model(torch.tensor([prompts[1] + [9]]))[0, -1]
    torch.testing.assert_close(moved[0], alone, rtol=1e-5, atol=1e-5)


def test_pool_refuses_writes_past_its_slots():
    pool = small_model().new_kv_pool(n_slots=2, max_len=8)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.step([1], [PrefillChunk(2, 0, 3)])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.step([1, 2, 3])
    with pytest.raises(ValueError, match="8 positions"):
        pool.step([3, 8])
    with pytest.raises(ValueError, match="8 positions"):
        pool.step([], [PrefillChunk(0, 6, 3)])
