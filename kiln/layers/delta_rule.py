"""The gated delta rule (Gated DeltaNet's linear attention), one token at a time and by chunks.

Each head keeps a state ``S`` (``[key_dim, value_dim]``, float32). For a token with query ``q``,
key ``k`` (both L2-normalised; ``q`` also times ``key_dim ** -0.5``), value ``v``, log-decay
``g <= 0`` and write strength ``beta`` in (0, 1)::

    S <- exp(g) * S                      forget a little
    u  = beta * (v - k^T S)              what the state mispredicts for k, scaled
    S <- S + k u^T                       write the correction
    o  = q^T S

By chunks of ``C`` tokens (the WY form): with ``G_t`` the decay from the chunk's start through
``t`` and ``S0`` the state before it, the corrections of the chunk solve one unit lower
triangular system, ``(I + A) U = beta V - (beta G K) S0`` with ``A[t, i] = beta_t (G_t / G_i)
k_t.k_i`` for ``i < t``, and then::

    O  = (G Q) S0 + ((G_t / G_i) q_t.k_i for i <= t) U
    S' = G_C S0 + ((G_C / G) K)^T U

which is the token-by-token result (in float32 rounding) with a few matrix products a chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of ``n`` sequences: ``q``, ``k`` ``[n, heads, key_dim]``, ``v``
    ``[n, heads, value_dim]``, ``g``, ``beta`` ``[n, heads]``, ``state`` ``[n, heads, key_dim,
    value_dim]`` (all float32). Returns the outputs ``[n, heads, value_dim]`` and the new states."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("nhk,nhkv->nhv", k, state)
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * correction[..., None, :]
    return torch.einsum("nhk,nhkv->nhv", q, state), state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of one sequence: ``q``, ``k`` ``[length, heads, key_dim]``, ``v`` ``[length,
    heads, value_dim]``, ``g``, ``beta`` ``[length, heads]``, ``state`` ``[heads, key_dim,
    value_dim]`` (float32). Returns the outputs ``[length, heads, value_dim]`` and the state after
    the last token."""
    length = q.shape[0]
    pad = -length % chunk
    # Head-major, padded to whole chunks (padding: g 0 and beta 0 leave the state as it is).
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [heads, padded, dim]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [heads, padded]
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    strictly_lower = causal.tril(-1)
    outputs = []
    for start in range(0, length + pad, chunk):
        cq, ck, cv = (x[:, start:start + chunk] for x in (q, k, v))
        cb = beta[:, start:start + chunk, None]  # [heads, C, 1]
        decay = g[:, start:start + chunk].cumsum(-1)  # log G_t
        ratio = (decay[:, :, None] - decay[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # G_t / G_i
        system = torch.eye(chunk) + ((cb * ck) @ ck.transpose(1, 2) * ratio).masked_fill(~strictly_lower, 0.0)
        rhs = torch.cat([cb * cv, cb * decay.exp()[..., None] * ck], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        corrections = solved[..., :cv.shape[-1]] - solved[..., cv.shape[-1]:] @ state  # U
        outputs.append((decay.exp()[..., None] * cq) @ state + (cq @ ck.transpose(1, 2) * ratio) @ corrections)
        last = decay[:, -1:]  # log G_C
        state = last.exp()[..., None] * state + ((last - decay).exp()[..., None] * ck).transpose(1, 2) @ corrections
    out = torch.cat(outputs, dim=1)[:, :length].transpose(0, 1)  # [length, heads, value_dim]
    return out, state
