"""ModelRunner: turns a SchedulerOutput into one packed forward pass and sampled tokens.

A step is first reduced to plain data (``StepInputs``: token ids, positions, block tables, the
rows to sample, LoRA rows, prompt tables), which is all the other ranks of a world need to
compute their part of it (``kiln.runtime.worker``).

Who samples: the rank holding the logits. In one process or with tensor parallelism alone
that is rank 0, the scheduler's. With pipeline stages each stage hands its last layer's output
to the next (``send_tensor``), and the last stage's first rank samples and returns the tokens
(``kiln.runtime.worker.Sampler``): ``submit`` starts a step and ``collect`` takes its results,
so rank 0 can start the next micro-batch in between.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from kiln.distributed.comm import recv_tensor, send_tensor
from kiln.dtypes import torch_dtype
from kiln.errors import KilnError, WorldError
from kiln.layers.lora import LoraStep
from kiln.models.hybrid import attention_modules, is_recurrent
from kiln.models.mtp import mtp_attention
from kiln.runtime.engine import Engine
from kiln.runtime.grammar_masks import GrammarMasks
from kiln.runtime.logits_processors import TokenHistory, process_logits
from kiln.runtime.mtp import MtpProposer
from kiln.runtime.prompt_tuning import prompt_step
from kiln.runtime.request_processor import RequestProcessor
from kiln.runtime.sampling import sample
from kiln.runtime.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput, TokenResult
from kiln.runtime.sequence import Sequence
from kiln.runtime.verification import verify
from kiln.step.attention import BACKENDS, select_backend
from kiln.runtime.kv_blocks import state_slot_counts, state_specs
from kiln.step.kv_cache import allocate_layer_caches, indexable, kv_cache_dtype
from kiln.step.state_cache import allocate_state_caches, copy_state_slots, state_bytes_per_slot
from kiln.step.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# The longest chunk of generated tokens run as one-token queries (a decode step) rather than as a
# prompt chunk: verification (proposals and one) and a draft model's catch-up are this short.
MAX_SPLIT_TOKENS = 17

ACTIVATIONS_TAG = 2  # a stage's output to the next stage


@dataclass
class StepInputs:
    """One step as plain data. ``context_rows``: (offset, count) spans of prompt tokens whose
    logits are returned; ``lora``: [(adapter, token rows)]; ``prompts``: the prompt-tuning step."""

    new_blocks: list[int]
    block_copies: list[tuple[int, int]]
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    last_token: list[int]
    context_rows: list[tuple[int, int]]
    lora: list[tuple[object, list[int]]]
    prompts: object
    # Hybrid models: each sequence's recurrent-state slots (read, write), and whole slots to copy
    # (src, dst) before the step (a beam taking its parent's state); None / [] otherwise.
    state_slots: list[tuple[int, int]] | None = None
    state_copies: list[tuple[int, int]] = field(default_factory=list)


class ModelRunner:
    """Owns the KV cache of one engine and executes steps on it."""

    def __init__(self, engine: Engine, num_blocks: int, attention_backend: str = "auto", max_num_seqs: int = 1,
                 mtp_tokens: int = 0):
        self.engine = engine
        self.model = engine.model
        self.block_size = engine.build_config.tokens_per_block
        self.num_blocks = num_blocks
        config = engine.config
        layers = list(self.model.transformer.layers.values())
        attentions = attention_modules(layers) + ([mtp_attention(self.model)] if mtp_tokens else [])
        kv_pairs = allocate_layer_caches(attentions, num_blocks, self.block_size, kv_cache_dtype(config))
        # A hybrid model's recurrent layers keep state slots (kiln.runtime.state_slots) instead,
        # and checkpoints of them for prefix caching (all only committed once written).
        self.num_state_slots = sum(state_slot_counts(engine, max_num_seqs))
        specs = state_specs(self.model)
        self.state_caches = allocate_state_caches(specs, self.num_state_slots)
        self.state_slot_bytes = state_bytes_per_slot(specs)  # over this rank's recurrent layers
        kv, states = iter(kv_pairs), iter(self.state_caches)
        self.kv_pairs = kv_pairs  # the attention layers' (K, V), which block copies and clears touch
        self.kv_caches = [next(states) if is_recurrent(layer) else next(kv) for layer in layers]  # each layer's cache
        self.backend = BACKENDS[select_backend(attention_backend, torch_dtype(config.dtype))]()
        # Speculative decoding's MTP method: the model's MTP layer guesses after each step (its K/V the last pair).
        self.mtp = MtpProposer(self.model, kv_pairs[-1], self.backend, self.block_size, mtp_tokens) if mtp_tokens else None
        self._hidden: torch.Tensor | None = None  # the last step's final hidden states, for the MTP
        self.history = TokenHistory(engine.build_config.max_seq_len, config.vocab_size)
        # A front end (LLM, the server) gives its own tokenizer; a bare Executor or a pipeline's
        # sampling rank reads the engine's stored one when the first constrained request comes.
        self.grammars = GrammarMasks(lambda: RequestProcessor.load(engine.tokenizer_dir, engine.engine_dir,
                                                                   config.vocab_size).grammar_tokenizer())
        self._lora_targets_assigned = False
        self.mapping = config.mapping
        # On rank 0 of a world: hands every step to the other ranks (kiln.runtime.worker).
        self.leader = None
        # Per submitted step, in order: its results, or None while another rank samples them.
        self._submitted: deque[RunnerOutput | None] = deque()

    def release(self, seq: Sequence) -> None:
        """Drop per-sequence state of a finished sequence (or one whose tokens were rewritten:
        a beam re-formed)."""
        self.history.reset(seq)
        self.grammars.release(seq)
        if self.leader is not None:
            self.leader.forget(seq)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-write of shared blocks)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies])
        dst = torch.tensor([d for _, d in copies])
        for k, v in self.kv_pairs:
            k[dst] = k[src]
            v[dst] = v[src]

    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero newly allocated blocks where the backend reads whole blocks under a mask: the
        unwritten tail of a block must not hold stale NaN/inf bit patterns. (Backends that read
        only written slots skip it; at 64 sequences it cost 5 ms a step.)"""
        if not blocks or not self.backend.reads_whole_blocks:
            return
        index = torch.tensor(blocks)
        for k, v in self.kv_pairs:
            indexable(k).index_fill_(0, index, 0)  # zero bytes: 0.0 in every cache type
            indexable(v).index_fill_(0, index, 0)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the scheduled step and sample its completed sequences."""
        self.submit(out)
        return self.collect()

    @torch.inference_mode()
    def submit(self, out: SchedulerOutput) -> None:
        """Start the scheduled step: hand it to the other ranks of a world (``kiln.runtime.worker``),
        compute this rank's part, and sample it here when this rank holds the logits.

        In one process a step that raises is run again one request at a time (``_run_apart``),
        so a request that cannot be computed fails alone. (In a world the other ranks already
        computed their parts of the whole step: there an error ends the step.)"""
        if self.leader is not None:
            self._submit(out)
            return
        try:
            self._submit(out)
        except WorldError:
            raise
        except Exception as error:  # noqa: BLE001 - isolated below, or raised if no request is at fault
            self._submitted.append(self._run_apart(out, error))

    def _run_apart(self, out: SchedulerOutput, error: Exception) -> RunnerOutput:
        """Step ``out`` again, one request (sequence group) at a time: those that fail alone are
        listed in ``failed``. Raises ``error`` when every one of several fails (the engine, not a
        request, is at fault). Rerunning is safe: the failed step advanced no sequence, so the
        rerun writes the same K/V slots again (a seeded request draws afresh)."""
        groups: dict[int, list[ScheduledChunk]] = {}
        for chunk in out.chunks:
            group = chunk.seq.group if chunk.seq.group is not None else chunk.seq
            groups.setdefault(id(group), []).append(chunk)
        result = RunnerOutput()
        failures = 0
        for chunks in groups.values():
            blocks = {b for chunk in chunks for b in chunk.seq.block_ids}
            slots = {slot for chunk in chunks for slot in chunk.seq.state_slots}
            part = SchedulerOutput(chunks=chunks, block_copies=[c for c in out.block_copies if c[1] in blocks],
                                   new_blocks=[b for b in out.new_blocks if b in blocks],
                                   state_copies=[c for c in out.state_copies if c[1] in slots])
            try:
                self._submit(part)
            except WorldError:
                raise
            except Exception as e:  # noqa: BLE001 - this request fails alone
                failures += 1
                logger.warning("a step failed for sequences %s: %r", [c.seq.seq_id for c in chunks], e,
                               exc_info=not isinstance(e, KilnError))
                result.failed.update({chunk.seq.seq_id: e for chunk in chunks})
                continue
            result.merge(self._submitted.pop())
        if failures == len(groups) > 1:
            raise error
        return result

    def _submit(self, out: SchedulerOutput) -> None:
        step, sampled_seqs, context_seqs = self._step_inputs(out)
        if step is None:
            self._submitted.append(RunnerOutput())
            return
        if self.leader is not None:
            self.leader.send_step(step, sampled_seqs, context_seqs)
        logits, context_logits = self.run_step(step)
        if self.mapping.is_last_pp_rank:
            result = self.finish_step(logits, context_logits, sampled_seqs, context_seqs)
            if self.mtp is not None:
                self.mtp.after_step(out.chunks, step.input_ids, self._hidden, result)
            self._submitted.append(result)
        else:
            self._submitted.append(None)  # the last stage samples it

    def collect(self) -> RunnerOutput:
        """The results of the oldest step submitted and not yet collected."""
        result = self._submitted.popleft()
        return result if result is not None else self.leader.receive_result()

    def finish_step(self, logits: torch.Tensor | None, context_logits: list[torch.Tensor],
                    sampled_seqs: list[Sequence], context_seqs: list[Sequence]) -> RunnerOutput:
        """A step's results from its logits: tokens sampled, logits kept where asked."""
        result = RunnerOutput()
        for seq, rows in zip(context_seqs, context_logits):
            result.context_logits[seq.seq_id] = rows
        if logits is None:
            return result
        if any(s.spec_tokens for s in sampled_seqs):
            logits = self._verify(logits, sampled_seqs, result)
            sampled_seqs = [s for s in sampled_seqs if not s.spec_tokens]
        for seq, row in zip(sampled_seqs, logits):
            if seq.return_generation_logits:
                result.generation_logits[seq.seq_id] = row.clone()
        if sampled_seqs:
            self._sample(logits, sampled_seqs, result)
        return result

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], result: RunnerOutput) -> torch.Tensor:
        """Verify the proposals of the sequences that have them (``result.verified``); returns the
        rows of the others, in order, for plain sampling."""
        plain, at = [], 0
        for seq in seqs:
            rows = 1 + len(seq.spec_tokens)
            if rows == 1:
                plain.append(at)
            else:
                try:
                    result.verified[seq.seq_id] = verify(logits[at:at + rows], seq, seq.spec_tokens, self.history,
                                                         self.grammars)
                except Exception as error:  # noqa: BLE001 - this sequence's request fails alone
                    result.failed[seq.seq_id] = error
            at += rows
        return logits[torch.tensor(plain, dtype=torch.long)]

    def _step_inputs(self, out: SchedulerOutput) -> tuple[StepInputs | None, list[Sequence], list[Sequence]]:
        """The step as plain data (what every rank needs to compute it), the sequences sampled
        and those returning context logits, in the step's order."""
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        last_token, sampled_seqs, context_rows, context_seqs = [], [], [], []
        for chunk in out.chunks:
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed_tokens
            if seq.return_context_logits and start < seq.num_prompt_tokens:
                context_rows.append((len(input_ids), min(n, seq.num_prompt_tokens - start)))
                context_seqs.append(seq)
            ids = seq.token_ids[start:start + n]
            if len(ids) < n:  # its proposed tokens follow (speculative decoding)
                ids = ids + seq.spec_tokens[:n - len(ids)]
            input_ids.extend(ids)
            positions.extend(range(start, start + n))
            # A chunk verifying proposals, or a few generated tokens to catch up with (a draft model's
            # sequence after the target kept its proposals), is as many one-token queries, each seeing
            # the positions up to its own, so it runs as a decode step does (native kernel included).
            # (Not with recurrent layers: a sequence's tokens run through its state in one chunk.)
            split = (chunk.completes and 1 < n <= MAX_SPLIT_TOKENS and start >= seq.num_prompt_tokens
                     and not self.num_state_slots)
            query_lens.extend([1] * n if split else [n])
            seq_lens.extend(range(start + 1, start + n + 1) if split else [start + n])
            tables.extend([seq.block_ids] * (n if split else 1))
            if chunk.completes:  # one logits row, or one per proposal and one after them
                last_token.extend(range(len(input_ids) - 1 - len(seq.spec_tokens), len(input_ids)))
                sampled_seqs.append(seq)
        if not input_ids and not out.new_blocks and not out.block_copies and not out.state_copies:
            return None, [], []
        lora = self._lora_rows(out)
        step = StepInputs(list(out.new_blocks), list(out.block_copies), input_ids, positions, query_lens, seq_lens,
                          tables, last_token, context_rows, lora,
                          prompt_step(out.chunks, input_ids, self.model.config.vocab_size) if input_ids else None)
        if self.num_state_slots:
            step.state_slots = [(c.seq.state_slots[0], c.seq.state_slots[1]) for c in out.chunks]
            step.state_copies = list(out.state_copies)
        return step, sampled_seqs, context_seqs

    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Compute ``step`` on this rank's part of the model: on the last pipeline stage, the
        float32 logits of its sampled rows (None when none) and each context-logits span's; on
        a stage before it, (None, []) once its output is on its way to the next stage."""
        self.clear_blocks(step.new_blocks)
        self.copy_blocks(step.block_copies)
        copy_state_slots(self.state_caches, step.state_copies)
        if not step.input_ids:
            return None, []
        md = AttentionMetadata.build(self.backend, step.query_lens, step.seq_lens, step.tables, self.block_size,
                                     self._lora_step(step.lora), step.prompts, step.state_slots)
        ids, positions = torch.tensor(step.input_ids), torch.tensor(step.positions)
        m = self.mapping
        hidden = None
        if not m.is_first_pp_rank:  # the same tensor-parallel rank of the previous stage sends it
            hidden = recv_tensor((len(step.input_ids), self.model.config.hidden_size),
                                 torch_dtype(self.model.config.dtype), m.rank - m.tp_size, ACTIVATIONS_TAG)
        context: list[torch.Tensor] = []
        logits = None
        if not m.is_last_pp_rank:
            send_tensor(self.model(ids, positions, md, self.kv_caches, hidden), m.rank + m.tp_size,
                        ACTIVATIONS_TAG)
            return None, []
        if hidden is None and not step.context_rows and len(step.query_lens) == len(step.input_ids) and not self.mtp:
            logits = self.model.decode_logits(ids, positions, md, self.kv_caches)  # one-token queries
            if logits is not None and len(step.last_token) < len(step.input_ids):
                logits = logits[torch.tensor(step.last_token, dtype=torch.long)]
        if logits is None:
            hidden = self.model(ids, positions, md, self.kv_caches, hidden)
            self._hidden = hidden if self.mtp is not None else None  # (an 8K prompt's states: not kept for nothing)
            context = [self.model.compute_logits(hidden[offset:offset + count])
                       for offset, count in step.context_rows]
            if step.last_token:
                logits = self.model.compute_logits(hidden[torch.tensor(step.last_token)])
        return logits, context

    def _lora_rows(self, out: SchedulerOutput) -> list[tuple[object, list[int]]]:
        """The step's token rows grouped by LoRA adapter: [(adapter, rows)]."""
        rows: dict[int, tuple[object, list[int]]] = {}
        offset = 0
        for chunk in out.chunks:
            adapter = chunk.seq.lora
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(offset, offset + chunk.num_tokens))
            offset += chunk.num_tokens
        return list(rows.values())

    def _lora_step(self, lora: list[tuple[object, list[int]]]) -> LoraStep | None:
        """The step's LoraStep (None when no sequence has an adapter)."""
        if not lora:
            return None
        if not self._lora_targets_assigned:
            self.model.assign_lora_targets()
            self._lora_targets_assigned = True
        return LoraStep([(adapter, torch.tensor(rows)) for adapter, rows in lora])

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], result: RunnerOutput) -> None:
        beam_rows = [i for i, s in enumerate(seqs) if s.params.use_beam_search]
        if beam_rows:
            # Beam search ranks log-probs, processed after normalisation (as HF does).
            idx = torch.tensor(beam_rows)
            beam_seqs = [seqs[i] for i in beam_rows]
            logprobs = process_logits(logits[idx].log_softmax(dim=-1), beam_seqs, self.history)
            for seq, row in zip(beam_seqs, logprobs):
                result.beam_logprobs[seq.seq_id] = row
        rows = [i for i, s in enumerate(seqs) if not s.params.use_beam_search]
        if not rows:
            return
        sample_seqs = [seqs[i] for i in rows]
        logits = logits if len(rows) == len(seqs) else logits[torch.tensor(rows)]
        logits = process_logits(logits, sample_seqs, self.history)
        self.grammars.apply(logits, sample_seqs)
        drawn = sample(logits, sample_seqs)
        tokens = drawn.tokens.tolist()
        logprobs = drawn.logprobs.tolist() if drawn.logprobs is not None else [None] * len(rows)
        tops = drawn.top_logprobs or [None] * len(rows)
        for seq, token, logprob, top in zip(sample_seqs, tokens, logprobs, tops):
            result.tokens[seq.seq_id] = TokenResult(token, logprob, top or None)
