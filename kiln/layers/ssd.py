"""Mamba2's selective state-space recurrence (SSD), one token at a time and by chunks.

Each head keeps a state ``S`` (``[head_dim, state_size]``, float32). Heads come in ``groups``
that share the token's input and output projections ``B`` and ``C`` (``[state_size]`` each,
head ``h`` reading group ``h // (heads / groups)``). For a token with input ``x``
(``[head_dim]``), step ``dt > 0`` and the head's ``A < 0``::

    S <- exp(dt A) S + dt x B^T          forget, then write
    y  = S C + D x                        read (and skip)

By chunks of ``L`` tokens (the state space duality: within a chunk the recurrence is a masked
attention): with ``a_t = dt_t A``, ``c_t`` its sum from the chunk's start through ``t`` and
``S0`` the state before the chunk::

    y_t = exp(c_t) S0 C_t + sum_{s <= t} exp(c_t - c_s) (C_t . B_s) dt_s x_s     (+ D x_t)
    S'  = exp(c_L) S0 + sum_s exp(c_L - c_s) dt_s x_s B_s^T

which is the token-by-token result (in float32 rounding) with a few matrix products a chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 128


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of ``n`` sequences: ``x`` ``[n, heads, head_dim]``, ``dt`` ``[n, heads]``,
    ``a``, ``d`` ``[heads]``, ``b``, ``c`` ``[n, groups, state_size]``, ``state`` ``[n, heads,
    head_dim, state_size]`` (all float32). Returns the outputs ``[n, heads, head_dim]`` and the
    new states."""
    n, heads, head_dim = x.shape
    groups = b.shape[1]
    x = x.view(n, groups, heads // groups, head_dim)
    state = state.view(n, groups, heads // groups, head_dim, -1)
    decay = (dt * a).exp().view(n, groups, -1, 1, 1)
    written = (dt.view(n, groups, -1, 1) * x)[..., None] * b[:, :, None, None, :]
    state = decay * state + written
    y = torch.einsum("ngrpk,ngk->ngrp", state, c) + d.view(groups, -1, 1) * x
    return y.reshape(n, heads, head_dim), state.reshape(n, heads, head_dim, -1)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of one sequence: ``x`` ``[length, heads, head_dim]``, ``dt`` ``[length, heads]``,
    ``a``, ``d`` ``[heads]``, ``b``, ``c`` ``[length, groups, state_size]``, ``state`` ``[heads,
    head_dim, state_size]`` (float32). Returns the outputs ``[length, heads, head_dim]`` and the
    state after the last token."""
    length, heads, head_dim = x.shape
    groups = b.shape[1]
    per_group = heads // groups
    pad = -length % chunk
    # Group-major, padded to whole chunks (padding: dt 0 leaves the state as it is).
    xs = F.pad(x, (0, 0, 0, 0, 0, pad)).view(-1, groups, per_group, head_dim).permute(1, 2, 0, 3)  # [G, R, T, P]
    steps = F.pad(dt, (0, 0, 0, pad)).view(-1, groups, per_group).permute(1, 2, 0)  # [G, R, T]
    bs, cs = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (b, c))  # [G, T, N]
    log_decay = steps * a.view(groups, per_group, 1)
    state = state.view(groups, per_group, head_dim, -1)  # [G, R, P, N]
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    outputs = []
    for start in range(0, length + pad, chunk):
        span = slice(start, start + chunk)
        cx, cb, cc = xs[:, :, span], bs[:, span], cs[:, span]
        weighted = steps[:, :, span, None] * cx  # dt_s x_s  [G, R, L, P]
        cum = log_decay[:, :, span].cumsum(-1)  # c_t  [G, R, L]
        ratio = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        scores = (cc @ cb.transpose(1, 2))[:, None] * ratio  # [G, R, L, L]
        from_state = torch.einsum("gln,grpn->grlp", cc, state) * cum.exp()[..., None]
        outputs.append(scores @ weighted + from_state)
        last = cum[..., -1:]  # c_L
        state = (last.exp()[..., None] * state
                 + ((last - cum).exp()[..., None] * weighted).transpose(-1, -2) @ cb[:, None])
    y = torch.cat(outputs, dim=2)[:, :, :length]  # [G, R, length, P]
    y = y.permute(2, 0, 1, 3).reshape(length, heads, head_dim) + d.view(1, heads, 1) * x
    return y, state.reshape(heads, head_dim, -1)
