"""How well a written EAGLE-3 head drafts for its target (`train-drafter`'s report), measured
apart from the trainer's own forward:

- reference_acceptance: the numpy reference drafter (service/model/eagle3_forward.py) loaded
  from the file, run as the engine runs a head: one row per position with the target's tapped
  features (the extend), and from each start row of the generated part a greedy chain fed its
  own drafts and its own pre-norm outputs. Acceptance at depth d: the fraction of start rows
  whose drafts 1..d are all the target's choices (the starts of eagle3_fit.acceptance_starts).
  The reference's decode writes KV rows start.. and reads rows < start + n, so the chain's rows
  past P are invisible to the next real row at P + 1, which rewrites its own.
- engine_acceptance: the head served by the engine (`--drafter eagle3`, CPU or CUDA backend)
  on prompts run greedily, drafting at every step (the width policy's verify cost taken as 0,
  so an untrained head drafts as much as a trained one): drafts proposed and accepted, tokens
  per verify step, and whether every output equals plain greedy decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from service.config import EngineConfig
from service.engine.engine import Engine
from service.engine.types import (
    Delta,
    Finished,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from service.gguf.reader import GGUFFile
from service.model.eagle3 import Eagle3Spec
from service.model.eagle3_forward import Eagle3Draft
from service.tools.eagle3_data import TargetSequence
from service.tools.eagle3_fit import acceptance_starts, rows_of


def reference_acceptance(head: Path, target: Path, seqs: Sequence[TargetSequence],
                         depth: int) -> tuple[np.ndarray, int]:
    """(acceptance per depth (D,), start rows counted) of the file `head` (module doc)."""
    f = GGUFFile(head)
    spec = Eagle3Spec.from_gguf(f)
    ref = Eagle3Draft(spec, f, GGUFFile(target), max(len(s.ids) for s in seqs) + depth)
    hits, starts = np.zeros(depth), 0
    for s in seqs:
        feats, tokens, _, _ = rows_of(s)
        g = ref.encode(feats)                                           # (R, E) f32
        todo = set(acceptance_starts(s, depth).tolist())
        starts += len(todo)
        for P in range(len(tokens)):
            logits, y = ref.decode(tokens[P:P + 1], g[P:P + 1], P)      # (1, V), (1, E)
            if P not in todo:
                continue
            for j in range(depth):
                draft = int(logits[0].argmax())
                if draft != s.choice[P + 1 + j]:
                    break
                hits[j] += 1
                if j + 1 < depth:
                    logits, y = ref.decode([draft], y, P + 1 + j)
    return hits / max(starts, 1), starts


@dataclass(frozen=True)
class EngineAcceptance:
    drafted: int
    accepted: int
    tokens: int               # tokens decoded after each request's first
    steps: int                # target decode steps
    identical: bool           # every output equals plain greedy decoding's

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(self.steps, 1)


def _run(eng: Engine, prompt: Sequence[int], tokens: int, speculative: bool):
    req = GenerationRequest(request_id="train-drafter", prompt_ids=tuple(prompt),
                            sampling=SamplingParams(temperature=0.0),
                            stopping=StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
                            speculative=speculative)
    ids, finished = [], None
    for ev in eng.generate(req, timeout=600):
        if isinstance(ev, Delta):
            ids += ev.token_ids
        elif isinstance(ev, Finished):
            finished = ev
    return ids, finished.usage


def engine_acceptance(target: Path, heads: Sequence[Path], prompts: Sequence[Sequence[int]],
                      tokens: int, width: int, backend: str = "cpu", threads: int = 0
                      ) -> list[EngineAcceptance]:
    """Per head, the engine's drafts on `prompts` at verify width `width` (module doc)."""
    base = EngineConfig(backend=backend, threads=threads, n_slots=1, prefix_cache=False,
                        n_ctx=max(map(len, prompts)) + tokens + width + 1)
    eng = Engine.load(target, base)
    eng.start()
    try:
        plain = [_run(eng, p, tokens, False)[0] for p in prompts]
    finally:
        eng.stop(10)
    out = []
    for head in heads:
        eng = Engine.load(target, replace(base, drafter="eagle3", draft_model=str(head),
                                          verify_width=width))
        eng.start()
        eng.verify_alpha = 0.0
        drafted = accepted = made = steps = 0
        same = True
        try:
            for p, want in zip(prompts, plain, strict=True):
                ids, u = _run(eng, p, tokens, True)
                same &= ids == want
                drafted, accepted = drafted + u.draft_tokens, accepted + u.accepted_draft_tokens
                made, steps = made + u.completion_tokens - 1, steps + u.decode_steps
        finally:
            eng.stop(10)
        out.append(EngineAcceptance(drafted, accepted, made, steps, same))
    return out
