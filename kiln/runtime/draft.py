"""Speculative decoding's draft-model proposer: a smaller model (or a quantized copy of the
target) runs greedily in an engine core of its own, with its own paged KV cache.

Each target sequence that speculates has a mirror sequence in the draft core. Before a step the
mirror takes the target's tokens: what both agree on keeps its K/V (the proposals the target
kept), the rest is recomputed from there; then the draft core steps ``k`` times, every mirror
gaining a token a step, and the tokens past the target's are the proposals. The draft proposes
its argmax, a one-token proposal, so verification's rule keeps the target distribution exactly.

A draft with recurrent layers cannot drop tokens from its state: after the first step of each
round (when a mirror has taken the target's tokens), each mirror's state is copied into a
checkpoint slot of its own, and a mirror that must rewind (the target rejected a proposal)
starts again from that copy and recomputes the tokens past it.
"""
from __future__ import annotations

from kiln.errors import ConfigError, KilnError
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
        block = draft.build_config.tokens_per_block
        # As many tokens of KV cache as the target's, so every sequence the target holds has its mirror.
        self.core = core_class(draft, max_num_seqs=max_num_seqs, num_blocks=-(-target_tokens // block))
        self.max_seq_len = draft.build_config.max_seq_len
        self.params = SamplingParams(max_tokens=self.max_seq_len, temperature=0, ignore_eos=True)
        self._mirrors: dict[int, Sequence] = {}  # target seq_id -> its mirror in the draft core
        self._synced: dict[int, int] = {}  # target seq_id -> how many of its tokens the mirror took last time
        # A recurrent draft: the core's checkpoint slots (past its sequences', unused without prefix
        # caching), one per mirror: target seq_id -> (slot, the position its state is at).
        states = self.core.scheduler.states  # (None: no recurrent layers)
        self._recurrent = states is not None
        self._free_checkpoints = list(range(states.num_slots, self.core.runner.num_state_slots)) if states else []
        self._checkpoints: dict[int, tuple[int, int]] = {}

    def propose(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Set ``seq.spec_tokens`` (up to ``k`` tokens) of each ``(seq, k)``. The mirrors of other
        live sequences stay (one pausing its proposals catches up a few tokens when it resumes,
        instead of its whole prompt); ``forget`` drops a mirror when its sequence ends."""
        mirrors = {}
        for seq, k in wanted:
            mirror = self._sync(seq)
            if mirror is not None and k > 0:
                mirrors[seq.seq_id] = (seq, mirror, k)
        steps = max((k for _, _, k in mirrors.values()), default=0)
        for step in range(steps):
            self.core.step()
            if step == 0 and steps > 1 and self._recurrent:  # copied as the second step starts
                self._save_states({seq_id: mirror for seq_id, (_, mirror, _) in mirrors.items()})
        for seq, mirror, k in mirrors.values():
            seq.spec_tokens = mirror.token_ids[seq.num_tokens:seq.num_tokens + k]

    def forget(self, seq_id: int) -> None:
        """Drop the mirror of a target sequence (finished, or not speculating)."""
        mirror = self._mirrors.pop(seq_id, None)
        self._synced.pop(seq_id, None)
        if seq_id in self._checkpoints:
            self._free_checkpoints.append(self._checkpoints.pop(seq_id)[0])
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
            if agreed < mirror.num_computed_tokens and self._recurrent:
                agreed = self._restore_state(seq.seq_id, mirror, agreed)
            mirror.num_computed_tokens = min(agreed, mirror.num_computed_tokens)
        self._synced[seq.seq_id] = seq.num_tokens
        return mirror

    def _save_states(self, mirrors: dict[int, Sequence]) -> None:
        """Queue a copy of each running mirror's state (``mirrors``: by target seq_id) into its
        checkpoint slot."""
        for target_id, mirror in mirrors.items():
            if not mirror.state_slots or mirror.is_finished:  # (a checkpoint it has stays valid)
                continue
            if target_id in self._checkpoints:
                slot = self._checkpoints[target_id][0]
            elif self._free_checkpoints:
                slot = self._free_checkpoints.pop()
            else:  # (more mirrors than slots: this one recomputes from the start when it rewinds)
                continue
            self.core.scheduler.state_copies.append((mirror.state_slots[0], slot))
            self._checkpoints[target_id] = (slot, mirror.num_computed_tokens)

    def _restore_state(self, target_id: int, mirror: Sequence, agreed: int) -> int:
        """Where a recurrent mirror that must drop tokens past ``agreed`` starts again: its
        checkpoint's position (its copy queued into the current slot), or 0 without one."""
        slot, position = self._checkpoints.get(target_id, (None, 0))
        if slot is None or position > agreed or not mirror.state_slots:
            return 0
        self.core.scheduler.state_copies.append((slot, mirror.state_slots[0]))
        return position
