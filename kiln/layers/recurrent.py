"""What recurrent layers share: reading and writing a step's per-sequence states, and the short
causal depthwise convolution every hybrid family puts before its mixer (LFM2's short-conv block,
Gated DeltaNet's and Mamba2's input convolutions), with the last ``kernel - 1`` inputs carried
from one step to the next.

A recurrent layer gets, instead of a paged KV cache, its state tensors ``[slots, ...]``
(``kiln.step.state_cache``) and the step's ``metadata.state_groups``: runs of decode rows (one
token per sequence, processed together) and prompt chunks (one sequence each). For every group it
reads the sequences' states (zeros for a sequence's first chunk), runs its tokens and writes the
states after them to the write slots.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.checkpoint.shard_spec import ShardSpec


def read_state(tensor: torch.Tensor, group) -> torch.Tensor:
    """The states ``[count, ...]`` a group's sequences start from (a copy): their read slots, or
    zeros for a sequence's first chunk."""
    state = tensor[group.read]
    if bool(group.fresh.any()):
        state[group.fresh] = 0
    return state


def write_state(tensor: torch.Tensor, group, state: torch.Tensor) -> None:
    """Store the states ``[count, ...]`` after a group's tokens in its sequences' write slots."""
    tensor[group.write] = state.to(tensor.dtype)


def require_state_groups(metadata, layer_idx: int) -> list:
    """The step's state groups; a clear error when the runner gave none (a step built without
    state slots cannot run a recurrent layer)."""
    if metadata.state_groups is None:
        raise RuntimeError(f"layer {layer_idx} keeps a recurrent state, but the step has no state slots")
    return metadata.state_groups


class CausalConv1d(nn.Module):
    """A depthwise causal convolution over the tokens of each sequence: output ``t`` of a channel
    is ``bias + sum_k weight[k] * x[t - K + 1 + k]``, the inputs before a chunk coming from the
    carried state (the last ``K - 1`` inputs, ``[K - 1, channels]``, zeros before the first).

    ``weight`` is ``[channels, K]`` (Hugging Face's ``Conv1d`` weight ``[channels, 1, K]``
    squeezed on loading); an activation (``silu``: Gated DeltaNet, Mamba2) may follow."""

    def __init__(self, channels: int, kernel_size: int, bias: bool, activation: str | None = None, *,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if kernel_size < 2:
            raise ValueError(f"a causal convolution needs a kernel of 2 or more, got {kernel_size}")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(channels, kernel_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False) if bias else None

    def state_part(self, dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and type of its state in one slot: the last ``K - 1`` inputs."""
        return (self.kernel_size - 1, self.channels), dtype

    def load_spec(self, param_name: str, num_external: int) -> list[ShardSpec]:
        return [ShardSpec()] * num_external

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        weight = weights[0]
        return {key: weight.reshape(self.channels, -1) if key.endswith("weight") else weight}

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[count, length, channels]`` (each sequence's new inputs), ``state``
        ``[count, K - 1, channels]``: the outputs ``[count, length, channels]`` and the states
        after the inputs. Computed in float32, returned in ``x``'s type."""
        window = torch.cat([state.to(x.dtype), x], dim=1)  # [count, K - 1 + length, channels]
        taps = window.float().unfold(1, self.kernel_size, 1)  # [count, length, channels, K]
        out = (taps * self.weight.float()).sum(-1)
        if self.bias is not None:
            out = out + self.bias.float()
        if self.activation == "silu":
            out = torch.nn.functional.silu(out)
        elif self.activation is not None:
            raise ValueError(f"causal convolution activation {self.activation!r} is not supported")
        return out.to(x.dtype), window[:, -(self.kernel_size - 1):]
