"""Greedy speculation held to plain greedy output: a set of prompts run on one engine at one
verify width after another, each output compared with the plain run's, and what was drafted and
accepted at each width counted; sampled speculation held to plain sampling likewise; the plain
greedy outputs they are held to; and the sequence a drafter driven by hand reads, started
on a tapped prefill."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from service.engine.engine import Engine
from service.engine.runner import GREEDY as ROW_GREEDY
from service.engine.runner import StepInput
from service.engine.types import SamplingParams
from tests.support.engines import run


@dataclass(frozen=True)
class Acceptance:
    """The drafts of a set of greedy requests at one verify width: how many were proposed and
    accepted, and how many tokens the requests made after their first (the prefill's)."""

    width: int
    drafted: int
    accepted: int
    tokens: int

    @property
    def rate(self) -> float:
        """Accepted drafts over proposed ones."""
        return self.accepted / self.drafted

    @property
    def tokens_per_step(self) -> float:
        """Tokens per decode step: each step commits one target token besides its accepted
        drafts."""
        return self.tokens / (self.tokens - self.accepted)


def greedy_equals_plain_at_widths(eng: Engine, prompts: Sequence[Sequence[int]],
                                  plain_ids: Sequence[list[int]], *, widths: Sequence[int],
                                  max_new_tokens: int, label: str,
                                  names: Sequence[str] | None = None) -> Iterator[Acceptance]:
    """For each of `widths` in turn: every prompt run greedily with speculation on `eng`, to
    max_new_tokens past any end token, must give plain_ids[i]; at least one token is drafted;
    the width's Acceptance is printed and yielded. One engine serves every width: the width
    only bounds the drafts per step (the workspace is sized for the largest, MAX_VERIFY_WIDTH
    logits rows). Running past an end token keeps tokens per step exact (Usage counts the drafts
    accepted in the step that stops). label and names (default: the prompts) say which run and
    prompt failed."""
    for width in widths:
        eng.config = replace(eng.config, verify_width=width)
        drafted = accepted = tokens = 0
        for prompt, plain, name in zip(prompts, plain_ids, names or prompts, strict=True):
            out = run(eng, prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
            assert out.token_ids == plain, (label, width, name)
            u = out.finished.usage
            drafted, accepted = drafted + u.draft_tokens, accepted + u.accepted_draft_tokens
            tokens += u.completion_tokens - 1
        assert drafted > 0, (label, width)
        got = Acceptance(width, drafted, accepted, tokens)
        print(f"\n{label} width {width}: {accepted}/{drafted} drafts accepted "
              f"({got.rate:.1%}), {got.tokens_per_step:.2f} tokens per step")
        yield got


@dataclass
class DraftSeq:
    """What a drafter reads of a sequence (the engine's DraftState), for tests that drive a
    drafter by hand."""

    slot: int
    history: list[int] = field(default_factory=list)


def plain_greedy_ids(eng: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int
                     ) -> list[list[int]]:
    """Each prompt's greedy output on `eng` without speculation, max_new_tokens past any end
    token."""
    return [run(eng, p, max_new_tokens=max_new_tokens, ignore_eos=True,
                speculative=False).token_ids for p in prompts]


def sampled_equals_plain(eng: Engine, prompts: Sequence[Sequence[int]],
                         params: SamplingParams, max_new_tokens: int = 20) -> tuple[int, int]:
    """Every prompt sampled with `params` on `eng`, with speculation and without: the same
    tokens, text and top-1 log-probabilities. Returns the drafts (proposed, accepted)."""
    drafted = accepted = 0
    for prompt in prompts:
        kw = dict(max_new_tokens=max_new_tokens, ignore_eos=True, top_logprobs=1)
        plain = run(eng, prompt, params, speculative=False, **kw)
        spec = run(eng, prompt, params, speculative=True, **kw)
        assert spec.token_ids == plain.token_ids, (params, prompt)
        assert spec.text == plain.text and spec.logprobs == plain.logprobs
        drafted += spec.finished.usage.draft_tokens
        accepted += spec.finished.usage.accepted_draft_tokens
    return drafted, accepted


def start_tapped(d, runner, prompt: list[int], slot: int = 0) -> tuple[DraftSeq, StepInput]:
    """`prompt` prefilled through the target in `slot` with its rows tapped, and drafter d's
    `slot` started on it and extended with those rows: the sequence (the prompt, then the
    token the prefill chose) and the prefill's step (its rows: runner.hidden_states(step))."""
    P = len(prompt)
    inp = StepInput(prompt, range(P), [slot] * P, [P - 1], [ROW_GREEDY], hidden=True)
    st = DraftSeq(slot, [*prompt, int(runner.step(inp).token_ids[0])])
    d.start(st)
    d.extend(st, range(P), range(P), runner.hidden_states(inp))
    return st, inp


def prefill_and_extend(d, runner, prompt: list[int]) -> tuple[DraftSeq, int, np.ndarray]:
    """start_tapped in slot 0: the sequence, the seed the prefill chose, and the prompt's
    tapped rows on the host (P, the tap's width: 3 Et for EAGLE-3, P E for DFlash)."""
    st, inp = start_tapped(d, runner, prompt)
    return st, st.history[-1], np.array(runner.hidden_states(inp))


def trees_equal_plain_at_budgets(eng: Engine, prompts: Sequence[Sequence[int]],
                                 plain_ids: Sequence[list[int]], *, budgets: Sequence[int],
                                 max_new_tokens: int, label: str) -> None:
    """For each of `budgets` in turn, tree verify with that many nodes per step: every prompt
    run greedily on `eng`, to max_new_tokens past any end token, must give plain_ids[i]; at
    least one token is drafted; the drafts proposed and accepted are printed."""
    for budget in budgets:
        eng.config = replace(eng.config, tree_budget=budget)
        drafted = accepted = 0
        for prompt, plain in zip(prompts, plain_ids, strict=True):
            out = run(eng, prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
            assert out.token_ids == plain, (label, budget, prompt)
            drafted += out.finished.usage.draft_tokens
            accepted += out.finished.usage.accepted_draft_tokens
        print(f"\n{label} tree budget {budget}: {accepted}/{drafted} drafts accepted")
        assert drafted > 0
