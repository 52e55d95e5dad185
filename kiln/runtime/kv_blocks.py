"""How many KV cache blocks an engine gets: enough for every sequence at full length (or its
sliding window), capped at a share of the memory available, the same on every rank."""
from __future__ import annotations

from kiln.distributed import world_min
from kiln.models.decoder import layer_window
from kiln.runtime.engine import Engine
from kiln.step.kv_cache import available_memory_bytes, kv_cache_dtype, layer_cache_bytes_per_token

KV_CACHE_MEMORY_FRACTION = 0.3  # of the memory available at start-up, when no size is given


def common_window(model) -> int | None:
    """The sliding window every layer keeps to (the widest), or None if a layer attends to all
    positions: only then can blocks behind the window be released. (Every layer of the model:
    a pipeline stage holds only some, and all stages share the block tables.)"""
    config = model.config
    windows = [layer_window(config, i) for i in range(config.num_hidden_layers)]
    return None if not windows or None in windows else max(windows)


def default_num_blocks(engine: Engine, max_num_seqs: int, memory_fraction: float = KV_CACHE_MEMORY_FRACTION) -> int:
    """Blocks for every sequence at full length (with a sliding window on every layer, the
    window and one step), capped at a share of available memory."""
    build, config = engine.build_config, engine.config
    tokens = build.max_seq_len
    window = common_window(engine.model)
    if window is not None:  # as Scheduler.peak_blocks
        tokens = min(tokens, window + build.max_num_tokens + build.tokens_per_block)
    wanted = max_num_seqs * -(-tokens // build.tokens_per_block)
    attentions = [layer.attention for layer in engine.model.transformer.layers.values()]
    per_block = build.tokens_per_block * layer_cache_bytes_per_token(attentions, kv_cache_dtype(config))
    affordable = int(available_memory_bytes() * memory_fraction) // per_block
    return max(1, min(wanted, affordable))


def agreed_num_blocks(engine: Engine, num_blocks: int | None, max_num_seqs: int, memory_fraction: float) -> int:
    """``num_blocks``, or when None what memory affords (``default_num_blocks``), the smallest
    over the ranks of a world, so every rank holds the same blocks."""
    if num_blocks is None:
        num_blocks = default_num_blocks(engine, max_num_seqs, memory_fraction)
    return world_min(num_blocks)
