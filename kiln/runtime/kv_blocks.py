"""How many KV cache blocks an engine gets: enough for every sequence at full length (or its
sliding window), capped at a share of the memory available after a hybrid model's recurrent
state slots, the same on every rank; and how many state slots that model gets."""
from __future__ import annotations

from kiln.distributed import world_min
from kiln.models.decoder import layer_window
from kiln.models.hybrid import attention_modules, is_recurrent, recurrent_layer_ids
from kiln.models.mtp import mtp_attention
from kiln.runtime.engine import Engine
from kiln.step.kv_cache import available_memory_bytes, kv_cache_dtype, layer_cache_bytes_per_token
from kiln.step.state_cache import state_bytes_per_slot

KV_CACHE_MEMORY_FRACTION = 0.3  # of the memory available at start-up, when no size is given


def common_window(model) -> int | None:
    """The sliding window every layer keeps to (the widest), or None if a layer attends to all
    positions: only then can blocks behind the window be released. (Every layer of the model:
    a pipeline stage holds only some, and all stages share the block tables.)"""
    config = model.config
    recurrent = set(recurrent_layer_ids(config))  # (they keep no K/V)
    windows = [layer_window(config, i) for i in range(config.num_hidden_layers) if i not in recurrent]
    return None if not windows or None in windows else max(windows)


def state_slot_counts(engine: Engine, max_num_seqs: int) -> tuple[int, int]:
    """A hybrid model's recurrent-state slots: two for each sequence that may run at once (the
    batch limit's sequences, each of which a beam search may turn into ``max_beam_width`` beams),
    and checkpoints for prefix caching (``kiln.runtime.state_prefix_cache``): one for every two
    batch slots, at least two (a state is as large as thousands of tokens' K/V, so they come out
    of the KV budget); (0, 0) for a model without recurrent layers. Slots are committed as they
    are first written."""
    if not recurrent_layer_ids(engine.config):
        return 0, 0
    return 2 * max_num_seqs * max(1, engine.build_config.max_beam_width), max(2, max_num_seqs // 2)


def state_specs(model) -> list:
    """The state parts of each of this rank's recurrent layers, in layer order."""
    return [layer.state_spec() for layer in model.transformer.layers.values() if is_recurrent(layer)]


def state_cache_bytes(engine: Engine, max_num_seqs: int, prefix_caching: bool = False) -> int:
    """Bytes the sequences' recurrent-state slots take on this rank (and the checkpoints', with
    prefix caching)."""
    sequences, checkpoints = state_slot_counts(engine, max_num_seqs)
    slots = sequences + (checkpoints if prefix_caching else 0)
    return slots * state_bytes_per_slot(state_specs(engine.model))


def default_num_blocks(engine: Engine, max_num_seqs: int, memory_fraction: float = KV_CACHE_MEMORY_FRACTION,
                       mtp: bool = False, prefix_caching: bool = False) -> int:
    """Blocks for every sequence at full length (with a sliding window on every layer, the
    window and one step), capped at a share of available memory less the recurrent state slots
    (hybrid models: at least one block, even when the states take that share)."""
    build, config = engine.build_config, engine.config
    tokens = build.max_seq_len
    window = common_window(engine.model)
    if window is not None:  # as Scheduler.peak_blocks
        tokens = min(tokens, window + build.max_num_tokens + build.tokens_per_block)
    wanted = max_num_seqs * -(-tokens // build.tokens_per_block)
    attentions = attention_modules(engine.model.transformer.layers.values())
    if mtp:  # speculative decoding's mtp method keeps one more attention layer's K/V
        attentions.append(mtp_attention(engine.model))
    per_block = max(1, build.tokens_per_block * layer_cache_bytes_per_token(attentions, kv_cache_dtype(config)))
    budget = int(available_memory_bytes() * memory_fraction) - state_cache_bytes(engine, max_num_seqs, prefix_caching)
    affordable = max(budget, 0) // per_block
    return max(1, min(wanted, affordable))


def agreed_num_blocks(engine: Engine, num_blocks: int | None, max_num_seqs: int, memory_fraction: float,
                      mtp: bool = False, prefix_caching: bool = False) -> int:
    """``num_blocks``, or when None what memory affords (``default_num_blocks``), the smallest
    over the ranks of a world, so every rank holds the same blocks."""
    if num_blocks is None:
        num_blocks = default_num_blocks(engine, max_num_seqs, memory_fraction, mtp, prefix_caching)
    return world_min(num_blocks)
