"""A mixed step: the decode rows of a plan and the prefill chunks riding with them, as ONE
StepInput, and its output cut back into each part; and a segmented step of wide chunks
(`segmented_input`), whose choices `chunk_choices` cuts the same way.

A chunk's rows are a run of one sequence like a chain verify run: consecutive positions, each
row writing its KV row and seeing its sequence's rows up to its own position (the runner's
ordinary rows: KV row = position, attention below position + 1). The transformer computes
logits for the step's last rows only, so the rows are ordered

    [every chunk's rows that choose nothing] [the decode rows, all choosing] [each choosing
    chunk's last row]

(a prompt's final chunk chooses its first token with its last row, `choice(seq)`; any other
chunk chooses nothing). Row order within a step changes no row's bits: every row writes its
KV before any row attends, and on the backends' step-size-invariant path (steps of up to 64
rows) each row is computed alone whatever else the step holds. So a chunk gives the same KV
rows and the same first token in a shared step as in a step of its own, and a request's tokens
do not depend on what joined with it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from service.engine.runner.step import RowSampling, StepInput, StepOutput
from service.engine.scheduler.plan import PrefillChunk
from service.engine.scheduler.sequence import Sequence
from service.engine.spec.decode import Draft, choice, split, verify_input


def mixed_input(batch: list[tuple[Sequence, Draft]], chunks: Seq[PrefillChunk]) -> StepInput:
    """The decode batch's verify rows (spec/decode.verify_input) and `chunks` in one step."""
    if not chunks:
        return verify_input(batch)      # the same rows, in the same order
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    tail: list[tuple[int, int, int]] = []        # choosing rows: (id, position, slot)
    tail_sampling: list[RowSampling] = []
    for c in chunks:
        n = len(c.tokens) - (1 if c.choose else 0)
        ids += c.tokens[:n]
        pos += range(c.start, c.start + n)
        slots += [c.seq.slot] * n
        if c.choose:
            tail.append((c.tokens[-1], c.start + n, c.seq.slot))
            tail_sampling.append(choice(c.seq))
    head = len(ids)
    v = verify_input(batch) if batch else StepInput([], [], [])
    ids += [*v.token_ids, *(t[0] for t in tail)]
    pos += [*v.positions, *(t[1] for t in tail)]
    slots += [*v.slots, *(t[2] for t in tail)]
    T = len(ids)
    L = len(v.sampling) + len(tail)
    tree = {}
    if v.kv_positions is not None:      # tree verify rows: the others are ordinary rows
        def ordinary(a: Seq[int], b: Seq[int], f) -> list[int]:
            return [*map(f, pos[:head]), *a, *map(f, b)]
        tail_pos = pos[head + len(v.token_ids):]
        tree = {"kv_positions": ordinary(v.kv_positions, tail_pos, lambda p: p),
                "attn_lo": ordinary(v.attn_lo, tail_pos, lambda p: p + 1),
                "attn_mask": ordinary(v.attn_mask, tail_pos, lambda p: 0)}
    return StepInput(ids, pos, slots, range(T - L, T), [*v.sampling, *tail_sampling], **tree)


def split_mixed(batch: list[tuple[Sequence, Draft]], chunks: Seq[PrefillChunk],
                out: StepOutput) -> tuple[list[StepOutput], list[StepOutput | None]]:
    """The step's output cut into each decode sequence's segment (spec/decode.split) and each
    chunk's choice (None for a chunk that chooses nothing)."""
    n = len(out.token_ids) - sum(1 for c in chunks if c.choose)
    decode = split(batch, StepOutput(out.token_ids[:n], out.logprobs[:n])) if batch else []
    return decode, chunk_choices(chunks, out, n)


def chunk_choices(chunks: Seq[PrefillChunk], out: StepOutput, first: int = 0
                  ) -> list[StepOutput | None]:
    """Each chunk's choice from `out`, whose records from `first` on are the choosing chunks'
    in order (None for a chunk that chooses nothing)."""
    parts: list[StepOutput | None] = []
    for c in chunks:
        if c.choose:
            parts.append(StepOutput(out.token_ids[first:first + 1],
                                    out.logprobs[first:first + 1]))
            first += 1
        else:
            parts.append(None)
    return parts


def segmented_input(chunks: Seq[PrefillChunk]) -> StepInput:
    """Several prompts' chunks as ONE segmented step (runner/step.py StepInput.segments), each
    chunk a run of its own, its last row choosing where the chunk is a prompt's final one."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    for c in chunks:
        ids += c.tokens
        pos += range(c.start, c.start + len(c.tokens))
        slots += [c.seq.slot] * len(c.tokens)
        if c.choose:
            rows.append(len(ids) - 1)
    return StepInput(ids, pos, slots, rows, [choice(c.seq) for c in chunks if c.choose],
                     segments=[len(c.tokens) for c in chunks])
