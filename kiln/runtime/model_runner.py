"""ModelRunner: turns a SchedulerOutput into one packed forward pass and sampled tokens."""
from __future__ import annotations

import torch

from kiln.models.base import torch_dtype
from kiln.runtime.attention import BACKENDS
from kiln.runtime.engine import Engine
from kiln.runtime.kv_cache import allocate_kv_cache
from kiln.runtime.metadata import AttentionMetadata
from kiln.runtime.sampling import sample
from kiln.runtime.scheduler import RunnerOutput, SchedulerOutput


class ModelRunner:
    """Owns the KV cache of one engine and executes steps on it."""

    def __init__(self, engine: Engine, num_blocks: int, attention_backend: str = "torch"):
        self.engine = engine
        self.model = engine.model
        self.block_size = engine.build_config.tokens_per_block
        self.num_blocks = num_blocks
        config = engine.config
        attention = next(iter(self.model.transformer.layers.values())).attention
        self.kv_caches = allocate_kv_cache(len(self.model.transformer.layers), num_blocks, self.block_size,
                                           attention.num_kv_heads, attention.head_size, torch_dtype(config.dtype))
        self.backend = BACKENDS[attention_backend]()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, query_lens, seq_lens, tables, last_token, sampled_seqs = [], [], [], [], [], [], []
        for chunk in out.chunks:
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
            if chunk.completes:
                last_token.append(len(input_ids) - 1)
                sampled_seqs.append(seq)
        if not input_ids:
            return RunnerOutput(sampled={})
        md = AttentionMetadata.build(self.backend, query_lens, seq_lens, tables, self.block_size)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), md, self.kv_caches)
        if not sampled_seqs:
            return RunnerOutput(sampled={})
        logits = self.model.compute_logits(hidden[torch.tensor(last_token)])
        tokens = sample(logits, [s.params for s in sampled_seqs], [s.generator for s in sampled_seqs])
        return RunnerOutput(sampled={s.seq_id: t for s, t in zip(sampled_seqs, tokens.tolist())})
