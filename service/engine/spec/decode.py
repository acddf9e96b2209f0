"""The speculative side of a decode step: each row's draft, the verify step's rows, and what
each sequence commits from the step's choices.

- drafting (`Speculator.draft`): a row of a speculating sequence with n_draft > 0 gets a chain
  [seed, d1..dk] from the drafter, or with a tree budget a draft tree of n_draft + 1 nodes
  (tree_verify.draft_tree); any other row is its seed alone.
- rows (`verify_input`): every sequence's segment (chain rows, or tree rows with their KV rows
  and attention masks) in ONE StepInput, every row choosing a token: a row at depth d of a
  sequence's chain or tree exactly as plain decoding chooses the token d after its next one
  (its own sampling, seed and token index, `choice`; in a chain the penalty window sees the
  drafts before it, recorded into the token history by the same step).
- committing (`commit`): a chain accepts with chain.accept_chain, a tree follows its path
  (tree_verify.commit, which returns the KV rows to compact); the accepted tokens and the bonus
  are emitted, exactly plain decoding's next tokens (chain.py and tree.py say why).

The drafter's per-slot state follows the scheduler's slot changes (`slot_change`, `release`);
a drafter with its own KV cache gets the target's block table (`set_block_table`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import structlog

from service.engine.runner.step import RowSampling, StepInput, StepOutput
from service.engine.scheduler.plan import DecodeRow, SlotChange
from service.engine.scheduler.sequence import Sequence, advance_constrained
from service.engine.spec.chain import accept_chain
from service.engine.spec.drafters import Drafter, SlotView
from service.engine.spec.tree import Tree
from service.engine.spec.tree_verify import commit as commit_tree
from service.engine.spec.tree_verify import draft_tree, n_rows, rows, step_fields
from service.engine.stepprofile import DRAFT, OTHER, StepTimer

log = structlog.get_logger("specstream.engine")

Draft = list[int] | Tree
Move = tuple[int, np.ndarray, np.ndarray]   # (slot, KV rows written, rows they belong in)


def choice(seq: Sequence, ahead: int = 0, masked: bool = True) -> RowSampling:
    """How `seq` chooses the token `ahead` tokens after its next one (the draw's counter: the
    index of the token the row produces, as plain decoding would count it): its frequency /
    presence penalties count the generated tokens from the prompt's end, its logit adjustment
    is the sequence's for that index (logit_bias, min_tokens bans). masked=False: without the
    constraint's mask (an overlapped row whose mask needs the token still in flight)."""
    index = len(seq.generated) + ahead
    base = seq.row_template        # the request's row, built once (its record's static words)
    if base is None:
        base = seq.row_template = RowSampling.of(
            seq.request.sampling, seq.seed_value, 0, seq.request.top_logprobs or -1,
            len(seq.request.prompt_ids))
    return base.at(index, seq.adjustment(index), seq.row_mask(ahead) if masked else None)


class Speculator:
    def __init__(self, drafter: Drafter | None):
        self.drafter = drafter

    def slot_change(self, change: SlotChange) -> None:
        """A sequence took or left a slot (the scheduler's plan)."""
        if self.drafter is not None:
            view = SlotView(change.slot, change.seq.history)
            (self.drafter.start if change.started else self.drafter.release)(view)

    def release(self, seq: Sequence) -> None:
        """`seq` ended while holding its slot."""
        if self.drafter is not None:
            self.drafter.release(seq)

    def overlaps(self, seqs: Seq[Sequence]) -> bool:
        """Whether plain steps of `seqs` (a plan that drafts nothing) may run overlapped
        (engine/overlap.py): none of them speculates, or their drafter reads no target hidden
        states (a tapping drafter must see every step's rows: `extend`); the loop asks the
        width policy after each step whether a sequence would draft (and a pure drafter
        whether it has drafts). A constrained one when it does not speculate: its fed rows
        either choose without the mask and are checked (greedy, Sequence.unmasked_exact) or
        sample once the host has filled the mask (overlap.masks_later)."""
        if any(s.matcher is not None and s.speculative for s in seqs):
            return False        # its drafts are walked through the matcher by the full plan
        return all(not s.speculative for s in seqs) or (
            self.drafter is not None and self.drafter.tap is None)

    def would_draft(self, seq: Sequence, n: int) -> bool:
        """Whether `seq`'s next step would carry drafts when the width policy wants n: n > 0
        and, for a pure drafter (cheap to ask), it proposes something; a model drafter is not
        asked here (drafting runs its model: the next plan does that)."""
        if n <= 0 or self.drafter is None:
            return False
        return bool(self.drafter.propose(seq, n)) if self.drafter.pure else True

    def set_block_table(self, table: np.ndarray) -> None:
        if self.drafter is not None:
            self.drafter.set_block_table(table)

    def taps(self, seqs: Seq[Sequence]) -> bool:
        """Whether a step computing rows of `seqs` copies the target's hidden states: the
        drafter reads them (EAGLE-3) and one of the sequences speculates."""
        d = self.drafter
        return d is not None and d.tap is not None and any(s.speculative for s in seqs)

    def extend(self, inp: StepInput, seqs: Seq[Sequence], hidden) -> None:
        """After a tapped step `inp` and its commits: each speculating sequence's rows of the
        step whose next token is committed (position p with history[p + 1]: a prompt row, the
        seed and the accepted drafts; not a rejected draft's row) go to the drafter with their
        hidden rows (`hidden`, the step's (n, P * E) rows, runner.hidden_states)."""
        if self.drafter is None or self.drafter.tap is None or not inp.hidden:
            return
        for seq in seqs:
            if seq.finished or not seq.speculative or seq.slot < 0:
                continue
            rows = committed_rows(inp, seq.slot, seq.history)
            if not len(rows):
                continue
            try:
                self.drafter.extend(seq, rows, np.asarray(inp.positions)[rows], hidden)
            except Exception as exc:   # the tokens are committed: the drafter only falls
                # behind (it drafts nothing for seq until a later extend catches it up)
                log.warning("drafter_extend_failed", request_id=seq.request.request_id,
                            error=f"{type(exc).__name__}: {exc}")

    def draft(self, plan: Seq[DecodeRow], timer: StepTimer | None = None
              ) -> list[tuple[Sequence, Draft]]:
        """Each row's sequence with what it verifies: [seed, drafts...] or a draft tree."""
        batch: list[tuple[Sequence, Draft]] = []
        for row in plan:
            seq, draft = row.seq, [row.seq.seed]
            # a tree sequence's plain step (its policy drafts nothing) is an ordinary row
            if seq.speculative and not (seq.tree_budget and not row.n_draft):
                if timer is not None:
                    timer.lap(OTHER)
                draft = (draft_tree(self.drafter, seq, row.n_draft + 1) if seq.tree_budget
                         else draft + self.drafter.propose(seq, row.n_draft))
                if seq.matcher is not None and not seq.tree_budget:
                    draft = [draft[0], *seq.constrain_draft(draft[1:])]
                if timer is not None:
                    timer.lap(DRAFT)
            batch.append((seq, draft))
        return batch


def committed_rows(inp: StepInput, slot: int, history: Seq[int]) -> np.ndarray:
    """The rows of step `inp` in `slot` whose token and every ancestor's (a tree row's
    attention mask) is the history's at its position and whose next token is committed,
    in position order: the rows of the committed positions (prompt rows, the seed and the
    accepted drafts; on a tree, the accepted path, whose siblings hold other tokens)."""
    ids, slots = np.asarray(inp.token_ids), np.asarray(inp.slots)           # (n,) each
    pos = np.asarray(inp.positions)                                        # (n,)
    h = np.asarray(history)
    mine = (slots == slot) & (pos + 1 < len(h))
    ok = np.zeros(len(ids), bool)
    ok[mine] = ids[mine] == h[pos[mine]]
    if inp.attn_mask is not None:       # tree rows: node j of the segment is row r0 + j
        node = np.asarray(inp.kv_positions) - np.asarray(inp.attn_lo)       # (n,)
        for r in np.nonzero(ok)[0]:
            bits, r0 = int(inp.attn_mask[r]), r - int(node[r])
            ok[r] = all(ok[r0 + j] for j in range(bits.bit_length()) if bits >> j & 1)
    rows = np.nonzero(ok)[0]
    return rows[np.argsort(pos[rows], kind="stable")]


def verify_input(batch: list[tuple[Sequence, Draft]]) -> StepInput:
    """Every row of the batch in one step; every row chooses a token."""
    if all(type(d) is list and len(d) == 1 for _, d in batch):
        return plain_input(batch)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sampling: list[RowSampling] = []
    segments = [rows(draft, seq.n_past) for seq, draft in batch]
    for (seq, _), seg in zip(batch, segments, strict=True):
        ids += seg.ids
        positions += seg.positions
        slots += [seq.slot] * len(seg.ids)
        sampling += [choice(seq, p - seq.n_past) for p in seg.positions]
    T = len(ids)
    return StepInput(ids, positions, slots, range(T), sampling, **step_fields(segments))


def plain_input(batch: list[tuple[Sequence, list[int]]]) -> StepInput:
    """The step of plain decode rows (each draft [seed] alone, at its sequence's next
    position): verify_input's rows for such a batch, one list per field instead of one
    segment per row."""
    return StepInput([d[0] for _, d in batch], [s.n_past for s, _ in batch],
                     [s.slot for s, _ in batch], range(len(batch)), [choice(s) for s, _ in batch])


def split(batch: list[tuple[Sequence, Draft]], out: StepOutput) -> list[StepOutput]:
    """The step's output cut into each sequence's segment."""
    parts, o = [], 0
    for _, draft in batch:
        n = n_rows(draft)
        parts.append(StepOutput(out.token_ids[o:o + n], out.logprobs[o:o + n]))
        o += n
    return parts


def advance_plain(batch: list[tuple[Sequence, Draft]], outs: Seq[StepOutput | None]) -> None:
    """Before the commits: the constrained sequences of plain rows accept their tokens and
    fill their next masks together (one batch over host threads, not one row at a time)."""
    advance_constrained([(seq, int(out.token_ids[0])) for (seq, draft), out
                         in zip(batch, outs, strict=True)
                         if out is not None and isinstance(draft, list) and len(draft) == 1])


def commit(seq: Sequence, draft: Draft, out: StepOutput) -> Move | None:
    """Accept `seq`'s segment, emit and advance it; a tree returns its KV rows to move."""
    if isinstance(draft, Tree):
        return commit_tree(seq, draft, out)
    if len(draft) == 1:
        seq.n_past += 1
        seq.count_step(1)
        seq.emit([int(out.token_ids[0])], out.logprobs)
        return None
    n_acc, emitted = accept_chain(draft, [int(t) for t in out.token_ids])
    seq.n_past += n_acc
    seq.count_step(n_acc)
    seq.record_verify(len(draft) - 1, n_acc - 1)
    seq.emit(emitted, out.logprobs[:n_acc])
    return None
