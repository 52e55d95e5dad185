"""Speculative decoding's MTP proposer: the target's own multi-token-prediction layer
(``kiln.models.mtp``) guesses the next tokens from the target's final hidden states
(``speculative_config={"method": "mtp"}``, vLLM's name).

After each step's tokens are chosen, every row the target computed for a sequence that may
speculate runs through the MTP layer too, with the token that followed it (the prompt's next
one, or the one sampled or verified), so the MTP's K/V cover every position (kept in the
sequence's own blocks: the MTP keeps the cache of one more attention layer). Rows past a rejected
proposal are dropped: their hidden states followed tokens the sequence does not have. For a
sequence that caught up, the MTP's last output gives the first guess through the LM head; each
further guess runs the MTP once more on the guess before it (its own output as the hidden state)
a position further on (the scheduler reserves those slots: ``lookahead_tokens``); a later step
writes those positions again from the target's states before any row reads them.
"""
from __future__ import annotations

import torch

from kiln.runtime.scheduler import RunnerOutput, ScheduledChunk
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative import can_speculate, speculation_pays
from kiln.step.metadata import AttentionMetadata


class MtpProposer:
    """Guesses up to ``num_tokens`` tokens a sequence with ``model``'s MTP layer (``model.mtp``),
    whose K/V live in ``kv_cache`` (blocks of ``block_size`` positions, ``backend``'s layout)."""

    def __init__(self, model, kv_cache, backend, block_size: int, num_tokens: int):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.block_size, self.num_tokens = block_size, num_tokens
        self.drafts: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (its token count then, guesses)

    # -- the Speculator's drafter interface ----------------------------------------------
    def propose(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Set ``seq.spec_tokens`` of each ``(seq, k)``: up to ``k`` of the guesses the last step
        made for it, if it still holds the tokens they follow."""
        for seq, k in wanted:
            count, guesses = self.drafts.pop(seq.seq_id, (None, []))
            if count == seq.num_tokens:
                seq.spec_tokens = guesses[:k]

    def forget(self, seq_id: int) -> None:
        self.drafts.pop(seq_id, None)

    # -- after each step --------------------------------------------------------------------
    @torch.inference_mode()
    def after_step(self, chunks: list[ScheduledChunk], input_ids: list[int], hidden: torch.Tensor,
                   result: RunnerOutput) -> None:
        """Run the step's rows (``hidden``: the target's final hidden states, one row per token of
        ``input_ids``) through the MTP and guess the next tokens of the sequences that caught up."""
        rows, ids, positions, query_lens, seq_lens, tables, drafting = [], [], [], [], [], [], []
        speculating = speculation_pays(len(chunks), self.num_tokens)
        at = 0
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            valid, following = self._rows(chunk, input_ids[at:at + chunk.num_tokens], result)
            if valid and can_speculate(seq):
                rows.extend(range(at, at + valid))
                ids.extend(following)
                positions.extend(range(start, start + valid))
                query_lens.append(valid)
                seq_lens.append(start + valid)
                tables.append(seq.block_ids)
                count = start + valid + 1  # the sequence's tokens once this step is applied
                k = min(self.num_tokens, seq.spec_limit or self.num_tokens, seq.max_total_tokens - count - 1)
                if chunk.completes and speculating and not seq.spec_pause and k > 0:
                    drafting.append((seq, len(ids) - 1, count, k))
            at += chunk.num_tokens
        if not rows:
            return
        out = self._run(ids, hidden[torch.tensor(rows)], positions, query_lens, seq_lens, tables)
        if drafting:
            self._guess(drafting, out[torch.tensor([row for _, row, _, _ in drafting])])

    def _guess(self, drafting: list[tuple[Sequence, int, int, int]], last: torch.Tensor) -> None:
        """Up to ``k`` guesses for each drafting ``(seq, row, count, k)`` from the MTP's output at its
        last row (``last``, one row each): the LM head's argmax, then the MTP again on that guess,
        its row at the position after the sequence's last computed one."""
        guesses: dict[int, list[int]] = {seq.seq_id: [] for seq, *_ in drafting}
        live = drafting
        for j in range(max(k for *_, k in drafting)):
            for (seq, *_), token in zip(live, self.model.compute_logits(last).argmax(dim=-1).tolist()):
                guesses[seq.seq_id].append(token)
            going = [i for i, (*_, k) in enumerate(live) if j + 1 < k]
            if not going:
                break
            live = [live[i] for i in going]
            positions = [count - 1 + j for _, _, count, _ in live]  # count - 2: the last row computed
            last = self._run([guesses[seq.seq_id][-1] for seq, *_ in live], last[torch.tensor(going)], positions,
                             [1] * len(live), [p + 1 for p in positions], [seq.block_ids for seq, *_ in live])
        for seq, _, count, _ in drafting:
            self.drafts[seq.seq_id] = (count, guesses[seq.seq_id])

    def _run(self, ids: list[int], hidden: torch.Tensor, positions: list[int], query_lens: list[int],
             seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        metadata = AttentionMetadata.build(self.backend, query_lens, seq_lens, tables, self.block_size)
        embeds = self.model.transformer.embed(torch.tensor(ids))
        return self.model.mtp(embeds, hidden, torch.tensor(positions), metadata, self.kv_cache)

    @staticmethod
    def _rows(chunk: ScheduledChunk, chunk_ids: list[int], result: RunnerOutput) -> tuple[int, list[int]]:
        """How many of a chunk's rows stand (from its first) and the token following each."""
        seq, n = chunk.seq, chunk.num_tokens
        start = seq.num_computed_tokens
        if seq.seq_id in result.failed:
            return 0, []
        if not chunk.completes:  # a prompt chunk: the prompt goes on
            return n, seq.token_ids[start + 1:start + n + 1]
        proposals = seq.spec_tokens
        behind = n - len(proposals)
        if proposals:
            chosen = [r.token for r in result.verified.get(seq.seq_id, [])]
            kept = next((i for i, (c, p) in enumerate(zip(chosen, proposals)) if c != p), min(len(chosen), len(proposals)))
            return (behind + kept, chunk_ids[1:behind] + chosen[:kept + 1]) if chosen else (0, [])
        sampled = result.tokens.get(seq.seq_id)
        return (n, chunk_ids[1:] + [sampled.token]) if sampled is not None else (0, [])
