"""Hugging Face PEFT LoRA adapters -> reference 004's ``weights`` / ``config`` tensors.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``) with ``...layers.{i}.{...}.{target}.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]`` per adapted linear. Each becomes one row: the target's module id
(``PEFT_TARGETS``), its layer, its rank, ``A`` and ``B`` times PEFT's scaling (``lora_alpha /
r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; ``rank_pattern`` and ``alpha_pattern`` per
module), so that ``B @ A`` is exactly the delta PEFT adds to the weight.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from kiln.checkpoint.format import atomic_output_dir
from kiln.checkpoint.lora import LORA_MODULE_IDS, LoraModule, pack_lora_tensors
from kiln.errors import CheckpointError

# PEFT target module names (LLaMA-style, and fused ones) -> reference module names. As in the
# reference's own converter, mlp_h_to_4h is gate_proj (the activated branch: kiln's and the
# reference's `fc`) and mlp_gate is up_proj, whatever the names suggest.
PEFT_TARGETS = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
    "qkv_proj": "attn_qkv", "query_key_value": "attn_qkv",
    "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h", "gate_up_proj": "mlp_gate_up",
}
WEIGHTS_FILE, CONFIG_FILE = "model.lora_weights.npy", "model.lora_config.npy"
STORAGE_TYPES = {"float16": torch.float16, "float32": torch.float32}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?([A-Za-z_]\w*)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def _read_adapter(adapter_dir: Path, check_type: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    if check_type and config.get("peft_type", "LORA") != "LORA":
        hint = " (prompt-tuning tables: kiln lora convert-prompt)" if config.get("peft_type") == "PROMPT_TUNING" else ""
        raise CheckpointError(f"{config_file}: peft_type {config.get('peft_type')!r}; kiln converts LORA adapters{hint}")
    safetensors_file, bin_file = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return config, load_file(str(safetensors_file))
        if bin_file.is_file():
            return config, torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which
        raise CheckpointError(f"{adapter_dir}: cannot read the adapter weights ({e})") from None
    raise CheckpointError(f"{adapter_dir}: no adapter_model.safetensors or adapter_model.bin")


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's per-module override: the first pattern matching the end of ``key``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def peft_prompt_table(adapter_dir: str | Path) -> torch.Tensor:
    """The virtual-token table ``[num_virtual_tokens, hidden]`` of a PEFT prompt-tuning adapter
    (its ``prompt_embeddings``), float32."""
    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        peft_type = json.loads(config_file.read_text()).get("peft_type")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    if peft_type != "PROMPT_TUNING":
        raise CheckpointError(f"{config_file}: peft_type {peft_type!r}; a prompt-tuning table comes from a "
                              "PROMPT_TUNING adapter")
    _, tensors = _read_adapter(adapter_dir, check_type=False)
    table = tensors.get("prompt_embeddings")
    if table is None or table.dim() != 2:
        raise CheckpointError(f"{adapter_dir}: no 2-D prompt_embeddings tensor in the adapter weights")
    return table.float()


def load_prompt_table(path: str | Path) -> torch.Tensor:
    """A prompt-tuning table from a PEFT prompt-tuning adapter directory or a ``.npy`` file
    (``kiln lora convert-prompt`` writes one)."""
    path = Path(path)
    if path.is_dir():
        return peft_prompt_table(path)
    try:
        return torch.from_numpy(np.load(path, allow_pickle=False))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read a prompt table ({e})") from None


def peft_to_lora_modules(adapter_dir: str | Path) -> list[LoraModule]:
    """The rows of a PEFT LoRA adapter, scaled as PEFT applies them, ordered by layer then
    module id."""
    adapter_dir = Path(adapter_dir)
    config, tensors = _read_adapter(adapter_dir)
    if config.get("use_dora"):
        raise CheckpointError(f"{adapter_dir}: a DoRA adapter; its magnitudes must be normalized against the base "
                              "weights, which this converter does not do yet")
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{adapter_dir}: bias {config['bias']!r}: the LoRA format has no bias terms")
    if config.get("modules_to_save"):
        raise CheckpointError(f"{adapter_dir}: modules_to_save {config['modules_to_save']} are whole weights, "
                              "which the LoRA format cannot carry")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _KEY.search(key)
        if found is None:
            raise CheckpointError(f"{adapter_dir}: tensor {key!r} is not a per-layer lora_A/lora_B weight "
                                  f"(targets kiln converts: {sorted(PEFT_TARGETS)})")
        layer, target, side = int(found.group(1)), found.group(2), found.group(3)
        if target not in PEFT_TARGETS:
            raise CheckpointError(f"{adapter_dir}: tensor {key!r} adapts {target!r}; kiln converts "
                                  f"{sorted(PEFT_TARGETS)}")
        pairs.setdefault((layer, target), {"key": key})[side] = tensor
    modules = []
    for (layer, target), pair in pairs.items():
        if "A" not in pair or "B" not in pair:
            raise CheckpointError(f"{adapter_dir}: layer {layer} {target} has lora_{'A' if 'A' not in pair else 'B'} "
                                  "missing")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise CheckpointError(f"{adapter_dir}: layer {layer} {target}: lora_A {list(a.shape)} and lora_B "
                                  f"{list(b.shape)} do not make a rank-r pair ([r, in] and [out, r])")
        rank = a.shape[0]
        module_key = pair["key"].split(".lora_")[0]
        alpha = _pattern_value(config.get("alpha_pattern"), module_key, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(LoraModule(LORA_MODULE_IDS[PEFT_TARGETS[target]], layer, a, b * scale))
    if not modules:
        raise CheckpointError(f"{adapter_dir}: the adapter has no LoRA weights")
    return sorted(modules, key=lambda m: (m.layer, m.module_id))


def convert_peft_adapter(adapter_dir: str | Path, output_dir: str | Path, storage_type: str = "float16") -> Path:
    """Write ``model.lora_weights.npy`` and ``model.lora_config.npy`` (int32) for a PEFT LoRA
    adapter into ``output_dir`` (atomically: nothing is left on an error)."""
    if storage_type not in STORAGE_TYPES:
        raise CheckpointError(f"--storage-type {storage_type!r}: choose one of {sorted(STORAGE_TYPES)}")
    weights, config = pack_lora_tensors(peft_to_lora_modules(adapter_dir), STORAGE_TYPES[storage_type])
    with atomic_output_dir(output_dir) as tmp:
        np.save(tmp / WEIGHTS_FILE, weights.numpy())
        np.save(tmp / CONFIG_FILE, config.numpy())
    return Path(output_dir)


def load_lora_dir(directory: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, config)`` as ``kiln lora convert`` writes them."""
    directory = Path(directory)
    out = []
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        try:
            out.append(np.load(directory / name, allow_pickle=False))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{directory / name}: cannot read ({e})") from None
    return out[0], out[1]


def read_adapter(directory: str | Path) -> tuple:
    """``(weights, config)`` of a LoRA adapter directory: a Hugging Face PEFT adapter
    (converted in memory) or what ``kiln lora convert`` wrote."""
    directory = Path(directory)
    if (directory / "adapter_config.json").is_file():
        return pack_lora_tensors(peft_to_lora_modules(directory))
    if not (directory / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{directory}: not a LoRA adapter (no adapter_config.json of a PEFT adapter, "
                              f"no {WEIGHTS_FILE} from kiln lora convert)")
    return load_lora_dir(directory)
