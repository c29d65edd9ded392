"""A stand-in for flash-attention's API (``flash_attn``) on the emulated MUSA card, where
flash-attn built for MUSA (or MATE's flash_attn API) would run: only on ``sys.path`` in the
tests that put it there (tests/test_emulated_flash.py), with a ``flash-attn`` distribution so
that transformers' ``is_flash_attn_2_available()`` finds it.

:func:`flash_attn_varlen_func` computes what the kernel computes: attention within each
sequence of the packed tokens (``cu_seqlens``), causal for a decoder, through SDPA on the
device. It is the reference the padding-free tests compare with (tests/test_padding_free.py's
``_varlen_reference`` calls :func:`varlen_attention`). No speed, no memory saving, no
numerics of a real kernel."""

from __future__ import annotations

import itertools

import torch

__version__ = "2.8.3"


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts: list[int],
    causal: bool,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention of ``query`` (tokens, heads, head_dim) over ``key`` / ``value`` (tokens,
    kv_heads, head_dim) within each sequence, the sequences starting at ``starts``; a kv head
    serves ``heads // kv_heads`` query heads in turn, as repeat_kv has it."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    out = torch.empty_like(query)
    for start, end in itertools.pairwise([*starts, query.shape[0]]):
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1),
            key[start:end].transpose(0, 1),
            value[start:end].transpose(0, 1),
            is_causal=causal,
            scale=scale,
            dropout_p=dropout,
        ).transpose(0, 1)
    return out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attn_varlen_func for self-attention over packed sequences (equal query and key
    sequences, as in training); what the stand-in does not model is refused."""
    if not torch.equal(cu_seqlens_q.cpu(), cu_seqlens_k.cpu()):
        raise NotImplementedError("the flash_attn stand-in: query and key sequences must match")
    unsupported = {
        "window_size": tuple(window_size) != (-1, -1),
        "softcap": bool(softcap),
        "alibi_slopes": alibi_slopes is not None,
        "return_attn_probs": return_attn_probs,
        "block_table": block_table is not None,
    }
    if any(unsupported.values()):
        names = ", ".join(name for name, given in unsupported.items() if given)
        raise NotImplementedError(f"the flash_attn stand-in does not model {names}")
    starts = cu_seqlens_q[:-1].tolist()
    return varlen_attention(q, k, v, starts, causal, softmax_scale, dropout_p)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **options: object,
) -> torch.Tensor:
    """flash_attn_func on (batch, length, heads, head_dim): each row a sequence (``options``:
    flash_attn_varlen_func's)."""
    batch, length = q.shape[:2]
    bounds = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)
    flat = [t.reshape(batch * length, *t.shape[2:]) for t in (q, k, v)]
    out = flash_attn_varlen_func(
        *flat, bounds, bounds, length, length, dropout_p, softmax_scale, causal, **options
    )
    return out.view(q.shape)


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("the flash_attn stand-in has no KV-cache kernel")
