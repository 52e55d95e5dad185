"""LoRA adapters in reference 004's tensor format.

An adapter is two tensors. ``config`` ``[rows, 3]`` holds ``[module_id, layer_idx,
adapter_size]`` per row (``[rows, 4]`` adds ``is_dora``); ``weights`` ``[rows, width]`` holds,
for the same row, the in-weights ``A`` ``[r, in]`` flattened, then the out-weights ``B``
``[out, r]`` flattened, then (DoRA rows) the ``out`` magnitude values, zero-padded to the
longest row. The adapter's delta for that module of that layer is ``B @ A`` (any
``lora_alpha / r`` scaling already folded into ``B``). Module ids are the reference's table
(``LORA_MODULE_IDS``, with kiln's own for recurrent mixers past them); a model gives the (in, out)
sizes of the modules each of its layers has (``ModuleShapes``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.errors import CheckpointError

# Reference 004's module ids: what each adapter row applies to.
LORA_MODULE_IDS: dict[str, int] = {
    "attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4,
    "mlp_h_to_4h": 5, "mlp_4h_to_h": 6, "mlp_gate": 7,
    "cross_attn_qkv": 8, "cross_attn_q": 9, "cross_attn_k": 10, "cross_attn_v": 11, "cross_attn_dense": 12,
    "moe_h_to_4h": 13, "moe_4h_to_h": 14, "moe_gate": 15, "moe_router": 16, "mlp_router": 17,
    "mlp_gate_up": 18,
    # kiln's own, past the reference's table (it predates recurrent layers): a short-convolution
    # or Mamba2 mixer's in_proj and any recurrent mixer's out_proj; Gated DeltaNet's four input
    # projections, and Qwen3-Next's two fused ones (qkv and z rows, b and a rows).
    "mixer_in": 19, "mixer_out": 20,
    "linear_attn_qkv": 21, "linear_attn_z": 22, "linear_attn_b": 23, "linear_attn_a": 24,
    "linear_attn_qkvz": 25, "linear_attn_ba": 26,
}
LORA_MODULE_NAMES: dict[int, str] = {i: name for name, i in LORA_MODULE_IDS.items()}
# Recurrent mixers' linears are whole on every rank of a tensor-parallel engine.
RECURRENT_MODULES = frozenset(range(19, 27))

# (layer, module id) -> (in, out) features: the modules a model takes adapters on, layer by
# layer (kiln.models.lora_targets.lora_module_shapes).
ModuleShapes = dict[tuple[int, int], tuple[int, int]]


@dataclass
class LoraModule:
    """One row of an adapter: module ``module_id`` of layer ``layer``, ``a`` ``[r, in]``,
    ``b`` ``[out, r]`` and, for DoRA, the normalized ``magnitude`` ``[out]``."""

    module_id: int
    layer: int
    a: torch.Tensor
    b: torch.Tensor
    magnitude: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def name(self) -> str:
        return LORA_MODULE_NAMES[self.module_id]


def engine_lora_shapes(shapes: ModuleShapes, lora_config: dict | None) -> ModuleShapes:
    """The model's ``shapes`` of the modules an engine takes adapters for: those its build named
    (``lora_config.lora_target_modules`` in the engine's config.json), or all of them."""
    if not lora_config or not lora_config.get("lora_target_modules"):
        return shapes
    allowed = {LORA_MODULE_IDS[name] for name in lora_config["lora_target_modules"]}
    return {key: shape for key, shape in shapes.items() if key[1] in allowed}


def module_names(shapes: ModuleShapes, layer: int | None = None) -> list[str]:
    """The module names in ``shapes`` (of one ``layer``, or of any), in id order."""
    return [LORA_MODULE_NAMES[i] for i in sorted({m for lay, m in shapes if layer is None or lay == layer})]


def _as_tensor(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        return torch.from_numpy(np.ascontiguousarray(value))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"LoRA {name}: expected a tensor or NumPy array, got {type(value).__name__}") from e


def parse_lora_tensors(weights, config, shapes: ModuleShapes, num_layers: int,
                       max_rank: int | None = None, dora: bool = True) -> list[LoraModule]:
    """The rows of an adapter in the reference format, checked against a model of ``num_layers``
    layers whose modules have ``shapes`` layer by layer; ``max_rank`` bounds the
    adapter size when the engine has one, ``dora`` False refuses DoRA rows (an engine built
    without ``--dora_plugin enable``). Every error names the row and the field."""
    w, c = _as_tensor(weights, "weights"), _as_tensor(config, "config")
    if c.dim() != 2 or c.shape[1] not in (3, 4):
        raise CheckpointError(f"LoRA config: expected shape [rows, 3] or [rows, 4] ([module_id, layer_idx, "
                              f"adapter_size(, is_dora)]), got {list(c.shape)}")
    if c.is_floating_point() and not torch.equal(c, c.round()):
        raise CheckpointError("LoRA config: module ids, layers, adapter sizes and is_dora must be whole numbers")
    if w.dim() != 2 or w.shape[0] != c.shape[0]:
        raise CheckpointError(f"LoRA weights: expected shape [{c.shape[0]}, width] (a row per config row), "
                              f"got {list(w.shape)}")
    if not w.is_floating_point():
        raise CheckpointError(f"LoRA weights: expected a floating-point tensor, got {w.dtype}")
    modules, seen, taken = [], {}, {m for _, m in shapes}
    for row, (module_id, layer, rank, *is_dora_field) in enumerate(c.long().tolist()):
        where = f"LoRA config row {row} ([{module_id}, {layer}, {rank}{''.join(f', {d}' for d in is_dora_field)}])"
        if module_id not in LORA_MODULE_NAMES:
            raise CheckpointError(f"{where}: unknown module_id {module_id} (the reference's ids are 0-18, "
                                  f"kiln's recurrent ones 19-{max(LORA_MODULE_NAMES)})")
        if module_id not in taken:
            raise CheckpointError(f"{where}: module {LORA_MODULE_NAMES[module_id]} (id {module_id}) is not one this "
                                  f"engine applies LoRA to; it takes {module_names(shapes)}")
        if not 0 <= layer < num_layers:
            raise CheckpointError(f"{where}: layer_idx {layer} is outside the model's {num_layers} layers")
        if (layer, module_id) not in shapes:
            raise CheckpointError(f"{where}: layer {layer} has no {LORA_MODULE_NAMES[module_id]}; its modules that "
                                  f"take adapters are {module_names(shapes, layer)}")
        if rank < 1 or (max_rank is not None and rank > max_rank):
            bound = f" (the engine's max_lora_rank is {max_rank})" if max_rank is not None else ""
            raise CheckpointError(f"{where}: adapter_size {rank} must be at least 1{bound}")
        is_dora = bool(is_dora_field and is_dora_field[0])
        if is_dora_field and is_dora_field[0] not in (0, 1):
            raise CheckpointError(f"{where}: is_dora must be 0 or 1, got {is_dora_field[0]}")
        if is_dora and not dora:
            raise CheckpointError(f"{where}: a DoRA row, but the engine was built without --dora_plugin enable "
                                  "(build with --dora_plugin enable to take DoRA adapters)")
        if (module_id, layer) in seen:
            raise CheckpointError(f"{where}: module {LORA_MODULE_NAMES[module_id]} of layer {layer} is already "
                                  f"given by row {seen[module_id, layer]}")
        seen[module_id, layer] = row
        size_in, size_out = shapes[layer, module_id]
        needed = rank * size_in + size_out * rank + (size_out if is_dora else 0)
        if needed > w.shape[1]:
            raise CheckpointError(f"{where}: needs {needed} weight values ({rank} x {size_in} in, {size_out} x "
                                  f"{rank} out{', ' + str(size_out) + ' DoRA magnitudes' if is_dora else ''}), "
                                  f"but weights rows hold {w.shape[1]}")
        values = w[row]
        a = values[: rank * size_in].reshape(rank, size_in)
        b = values[rank * size_in: rank * size_in + size_out * rank].reshape(size_out, rank)
        magnitude = values[rank * size_in + size_out * rank: needed] if is_dora else None
        modules.append(LoraModule(module_id, layer, a.clone(), b.clone(),
                                  magnitude.clone() if magnitude is not None else None))
    _check_dora_overlaps(modules, seen)
    return modules


# Fused modules and the parts they cover: an adapter holding both would adapt the same output
# columns twice, which DoRA cannot (each row's magnitude normalizes its own W + B A).
_FUSED_PARTS = {LORA_MODULE_IDS[fused]: {LORA_MODULE_IDS[n] for n in parts} for fused, parts in (
    ("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("mlp_gate_up", ("mlp_h_to_4h", "mlp_gate")),
    ("linear_attn_qkvz", ("linear_attn_qkv", "linear_attn_z")), ("linear_attn_ba", ("linear_attn_b", "linear_attn_a")))}


def _check_dora_overlaps(modules: list[LoraModule], rows_of: dict[tuple[int, int], int]) -> None:
    """``rows_of``: each (module id, layer)'s config row, for the error."""
    rows = {(m.layer, m.module_id): m for m in modules}
    for m in modules:
        for part in _FUSED_PARTS.get(m.module_id, ()):
            other = rows.get((m.layer, part))
            if other is not None and (m.magnitude is not None or other.magnitude is not None):
                raise CheckpointError(f"LoRA config rows {rows_of[m.module_id, m.layer]} and "
                                      f"{rows_of[part, m.layer]}: a DoRA row may not overlap another row of the "
                                      f"same linear (layer {m.layer}: {m.name} and {other.name} both adapt the "
                                      f"{other.name} columns)")


def pack_lora_tensors(modules: list[LoraModule], dtype: torch.dtype = torch.float32
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, config)`` in the reference format for ``modules`` (rows in the given order;
    4 config columns when any row is DoRA)."""
    dora = any(m.magnitude is not None for m in modules)
    rows = [torch.cat([m.a.reshape(-1), m.b.reshape(-1)]
                      + ([m.magnitude.reshape(-1)] if m.magnitude is not None else [])).to(dtype) for m in modules]
    width = max((r.numel() for r in rows), default=0)
    weights = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        weights[i, : r.numel()] = r
    config = torch.tensor([[m.module_id, m.layer, m.rank] + ([int(m.magnitude is not None)] if dora else [])
                           for m in modules], dtype=torch.int32).reshape(len(modules), 4 if dora else 3)
    return weights, config


# Reference 004's tensor-parallel rule: a ColumnLinear target splits its output features over
# ranks, so only B (out weights) is split, by rows of B; a RowLinear target splits its input
# features, so only A (in weights) is split, by columns of A. The other factor stays whole.
ROW_MODULES = frozenset({LORA_MODULE_IDS["attn_dense"], LORA_MODULE_IDS["mlp_4h_to_h"]})


def shard_lora_module(module: LoraModule, config, tp_size: int, tp_rank: int) -> LoraModule:
    """Rank ``tp_rank``'s share of ``module`` for a model of ``config`` split over ``tp_size``
    ranks. Fused targets split each of their parts as the fused linear does: q, k and v of
    ``attn_qkv`` (k and v whole on every rank of a group when there are fewer KV heads than
    ranks), gate and up of ``mlp_gate_up``. A recurrent mixer's modules stay whole (so are its
    linears)."""
    if tp_size == 1 or module.module_id in RECURRENT_MODULES:
        return module
    if module.module_id in ROW_MODULES:
        size_in = module.a.shape[1]
        if size_in % tp_size:
            raise CheckpointError(f"LoRA {module.name} of layer {module.layer}: {size_in} input features do not "
                                  f"split over {tp_size} ranks")
        part = size_in // tp_size
        return LoraModule(module.module_id, module.layer, module.a[:, tp_rank * part:(tp_rank + 1) * part].clone(),
                          module.b.clone(), module.magnitude)
    kv = config.num_key_value_heads * config.head_size
    if module.module_id == LORA_MODULE_IDS["attn_qkv"]:
        q = module.b.shape[0] - 2 * kv  # (twice the heads' width with an output gate: Qwen3.5)
        parts = [(0, q, tp_size, tp_rank), (q, kv, *_kv_split(config, tp_size, tp_rank)),
                 (q + kv, kv, *_kv_split(config, tp_size, tp_rank))]
    elif module.module_id in (LORA_MODULE_IDS["attn_k"], LORA_MODULE_IDS["attn_v"]):
        parts = [(0, kv, *_kv_split(config, tp_size, tp_rank))]
    elif module.module_id == LORA_MODULE_IDS["mlp_gate_up"]:
        inter = module.b.shape[0] // 2
        parts = [(0, inter, tp_size, tp_rank), (inter, inter, tp_size, tp_rank)]
    else:
        parts = [(0, module.b.shape[0], tp_size, tp_rank)]
    spans = []
    for start, size, ways, index in parts:
        if size % ways:
            raise CheckpointError(f"LoRA {module.name} of layer {module.layer}: {size} output features do not "
                                  f"split over {ways} ranks")
        spans.append(slice(start + index * (size // ways), start + (index + 1) * (size // ways)))
    b = torch.cat([module.b[span] for span in spans])
    magnitude = None if module.magnitude is None else torch.cat([module.magnitude[span] for span in spans])
    return LoraModule(module.module_id, module.layer, module.a.clone(), b, magnitude)


def _kv_split(config, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(ways, index) the K or V part splits into on ``tp_rank``: by KV heads, or, with fewer
    KV heads than ranks, each KV head whole on ``tp_size / num_kv_heads`` ranks."""
    ways = min(tp_size, config.num_key_value_heads)
    return ways, tp_rank * ways // tp_size
