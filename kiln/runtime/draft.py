"""Speculative decoding's draft-model proposer: a smaller model (or a quantized copy of the
target) runs greedily in an engine core of its own, with its own paged KV cache.

Each target sequence that speculates has a mirror sequence in the draft core. Before a step the
mirror takes the target's tokens: what both agree on keeps its K/V (the proposals the target
kept), the rest is recomputed from there; then the draft core steps ``k`` times, every mirror
gaining a token a step, and the tokens past the target's are the proposals. The draft proposes
its argmax, a one-token proposal, so verification's rule keeps the target distribution exactly.
"""
from __future__ import annotations

from kiln.errors import ConfigError, KilnError
from kiln.models.hybrid import recurrent_layer_ids
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import FinishReason, Sequence


class DraftProposer:
    """Proposals from a draft engine (``draft_dir``) for the sequences of a ``target`` engine."""

    def __init__(self, target: Engine, draft_dir: str, target_tokens: int, max_num_seqs: int, core_class):
        draft = Engine(draft_dir)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ConfigError(f"speculative_config.model {draft_dir}: its vocabulary ({draft.config.vocab_size}) "
                              f"is not the target's ({target.config.vocab_size}); a draft model shares the tokenizer")
        if recurrent_layer_ids(draft.config):  # its mirrors rewind to the agreed tokens, which a state cannot
            raise ConfigError(f"speculative_config.model {draft_dir}: a draft model with recurrent layers "
                              f"({draft.config.architecture}) is not supported yet")
        block = draft.build_config.tokens_per_block
        # As many tokens of KV cache as the target's, so every sequence the target holds has its mirror.
        self.core = core_class(draft, max_num_seqs=max_num_seqs, num_blocks=-(-target_tokens // block))
        self.max_seq_len = draft.build_config.max_seq_len
        self.params = SamplingParams(max_tokens=self.max_seq_len, temperature=0, ignore_eos=True)
        self._mirrors: dict[int, Sequence] = {}  # target seq_id -> its mirror in the draft core
        self._synced: dict[int, int] = {}  # target seq_id -> how many of its tokens the mirror took last time

    def propose(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Set ``seq.spec_tokens`` (up to ``k`` tokens) of each ``(seq, k)``. The mirrors of other
        live sequences stay (one pausing its proposals catches up a few tokens when it resumes,
        instead of its whole prompt); ``forget`` drops a mirror when its sequence ends."""
        mirrors = {}
        for seq, k in wanted:
            mirror = self._sync(seq)
            if mirror is not None and k > 0:
                mirrors[seq.seq_id] = (seq, mirror, k)
        for _ in range(max((k for _, _, k in mirrors.values()), default=0)):
            self.core.step()
        for seq, mirror, k in mirrors.values():
            seq.spec_tokens = mirror.token_ids[seq.num_tokens:seq.num_tokens + k]

    def forget(self, seq_id: int) -> None:
        """Drop the mirror of a target sequence (finished, or not speculating)."""
        mirror = self._mirrors.pop(seq_id, None)
        self._synced.pop(seq_id, None)
        if mirror is not None and not mirror.is_finished:
            self.core.finish_sequence(mirror, FinishReason.CANCELLED)

    def _sync(self, seq: Sequence) -> Sequence | None:
        """``seq``'s mirror holding its tokens (K/V kept as far as the two agree); None if the
        draft engine cannot hold it."""
        if seq.num_tokens + 1 >= self.max_seq_len:
            self.forget(seq.seq_id)
            return None
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None or mirror.is_finished:
            try:
                (mirror,) = self.core.add_request(list(seq.token_ids), self.params, None).seqs
            except KilnError:  # more than the draft engine takes (its max_input_len): no proposals
                return None
            self._mirrors[seq.seq_id] = mirror
        else:
            # The two agree up to what the mirror took last time, then as far as the target kept
            # its proposals; the mirror's K/V stand up to there.
            target, mine = seq.token_ids, mirror.token_ids
            agreed = self._synced[seq.seq_id]
            end = min(len(mine), len(target) - 1, mirror.num_computed_tokens)
            while agreed < end and mine[agreed] == target[agreed]:
                agreed += 1
            mirror.token_ids[:] = target
            mirror.num_computed_tokens = min(agreed, mirror.num_computed_tokens)
        self._synced[seq.seq_id] = seq.num_tokens
        return mirror

