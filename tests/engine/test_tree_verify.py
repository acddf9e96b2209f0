"""Tree verify (DDTree) on the CPU: greedy output with tree verify equals plain greedy output
token for token, with the model drafter at budgets 4, 8 and 16, the ngram drafter, on SmolLM2
and Gemma-3, and with a drafter built so that the accepted path leaves the leading chain (its
top-1 is wrong, its top-2 right), which makes every step compact KV rows.

Exact equality (not the near-tie rule of tests/support/near_ties.py): in steps of up to 16 rows
the CPU backend computes a tree row exactly as plain decoding computes the same token after the
same path (same keys in the same order, tests/unit/test_tree_attention.py), so the logits are
bit-identical. The GPU version of this gate (tests/gpu/test_tree_verify.py) uses the near-tie
rule, its attention tiles keys by KV row.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from service.engine.spec.drafters import Drafter
from tests.support.engines import Engine, run, running_engine
from tests.support.models import load_json

N_NEW = 16                       # tokens per prompt: several tree steps, modest CI time
FIXTURES = {"smollm2": "llamacpp_smollm2_greedy.json", "gemma3": "llamacpp_gemma3_greedy.json"}
N_CASES = {"smollm2": 4, "gemma3": 2}


def cases(model: str) -> list[dict]:
    return load_json(FIXTURES[model])["cases"][:N_CASES[model]]


def engine(model: str, **overrides):
    """Verify width 16, drafting in full (the machine's load must not decide how much)."""
    return running_engine(model, **{"verify_width": 16, **overrides}, draft_in_full=True)


@pytest.fixture(scope="module")
def plain() -> dict[str, list[list[int]]]:
    out = {}
    for model in FIXTURES:
        with running_engine(model) as eng:
            out[model] = [run(eng, c["prompt_ids"], max_new_tokens=N_NEW, ignore_eos=True,
                              speculative=False).token_ids for c in cases(model)]
    return out


@pytest.fixture(scope="module")
def draft_files(requantized) -> dict[str, str]:
    """model -> a 4-block q8_0 copy of it (a cheap drafter of the same vocabulary)."""
    return {m: str(requantized(m, "q8_0", 4)) for m in FIXTURES}


def check_identity(eng: Engine, model: str, plain_ids: list[list[int]], label: str):
    drafted = accepted = tokens = 0
    for case, want in zip(cases(model), plain_ids, strict=True):
        out = run(eng, case["prompt_ids"], max_new_tokens=N_NEW, ignore_eos=True)
        assert out.token_ids == want, (label, case["name"])
        u = out.finished.usage
        drafted, accepted = drafted + u.draft_tokens, accepted + u.accepted_draft_tokens
        tokens += u.completion_tokens - 1          # the first one comes from the prefill
    print(f"\n{label}: {accepted}/{drafted} drafts accepted, "
          f"{tokens / (tokens - accepted):.2f} tokens per step, {eng.stats.kv_moves} KV moves")
    return drafted, accepted


def test_model_drafter_trees_equal_plain_greedy_smollm2(plain, draft_files):
    with engine("smollm2", drafter="model", draft_model=draft_files["smollm2"],
                tree_budget=4) as eng:
        for budget in (4, 8, 16):
            eng.config = replace(eng.config, tree_budget=budget)
            drafted, _ = check_identity(eng, "smollm2", plain["smollm2"],
                                        f"smollm2 model drafter, budget {budget}")
            assert drafted > 0


def test_model_drafter_tree_equals_plain_greedy_gemma3(plain, draft_files):
    with engine("gemma3", drafter="model", draft_model=draft_files["gemma3"],
                tree_budget=8) as eng:
        drafted, _ = check_identity(eng, "gemma3", plain["gemma3"], "gemma3 model, budget 8")
        assert drafted > 0


@pytest.mark.parametrize("model", sorted(FIXTURES))
def test_ngram_chain_in_tree_mode_equals_plain_greedy(plain, model):
    with engine(model, drafter="ngram", tree_budget=8) as eng:
        check_identity(eng, model, plain[model], f"{model} ngram, budget 8")


class SecondBestDrafter(Drafter):
    """Knows plain greedy decoding's continuation of each prompt and ranks it SECOND at every
    depth, under a wrong token: the top-1 chain is always rejected and the accepted path runs
    through branches, so every step that accepts a draft must compact KV rows."""

    name = "second-best"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int):
        self.cont, self.vocab = continuations, vocab

    def _right(self, history: list[int], k: int) -> list[int]:
        prompt = next(p for p in self.cont if tuple(history[:len(p)]) == p)
        done = len(history) - len(prompt)
        return self.cont[prompt][done:done + k]

    def propose(self, seq, k: int) -> list[int]:
        return self._right(seq.history, k)

    def candidates(self, seq, k: int, n_top: int):
        right = self._right(seq.history, k)
        if not right:
            return [], np.zeros((0, n_top), np.int64), np.zeros((0, n_top))
        ids = np.array([[(r + 1) % self.vocab, r, (r + 2) % self.vocab] for r in right])
        logp = np.tile([-0.1, -0.15, -4.0], (len(right), 1))
        return [int(t) for t in ids[:, 0]], ids[:, :n_top], logp[:, :n_top]


def test_accepted_paths_off_the_leading_chain_are_compacted(plain, monkeypatch):
    model = "smollm2"
    with engine(model, drafter="ngram", tree_budget=8) as eng:
        eng.drafter = SecondBestDrafter(
            {tuple(c["prompt_ids"]): ids for c, ids in zip(cases(model), plain[model],
                                                            strict=True)}, eng.spec.vocab_size)
        drafted, accepted = check_identity(eng, model, plain[model], "second-best, budget 8")
        assert accepted > 0 and eng.stats.kv_moves >= accepted
        # negative control: without the compaction the accepted rows sit at the wrong KV rows
        monkeypatch.setattr("service.engine.engine.compact", lambda runner, moves: 0)
        outs = [run(eng, c["prompt_ids"], max_new_tokens=N_NEW, ignore_eos=True).token_ids
                for c in cases(model)]
        assert outs != plain[model]


class WrongDrafter(SecondBestDrafter):
    """Ranks three wrong tokens at every depth: every tree is rejected at its first node."""

    name = "wrong"

    def propose(self, seq, k: int) -> list[int]:
        return [(r + 1) % self.vocab for r in self._right(seq.history, k)]

    def candidates(self, seq, k: int, n_top: int):
        chain, ids, logp = super().candidates(seq, k, n_top)
        return chain, np.where(ids == np.array(self._right(seq.history, k))[:, None],
                               (ids + 3) % self.vocab, ids), logp


def test_trees_stop_where_they_do_not_pay_and_probe_rarely(plain):
    """The width policy prices a tree as it prices a chain: a sequence whose trees accept
    nothing (tree_gain 0: one token per step of 8 rows) decodes plainly after its first tree
    and tries a whole tree every probe_every() plain steps, and the next request does not
    start with a tree; drafting in full, every step is a tree. The output is plain greedy
    decoding's either way."""
    model, n_new = "smollm2", 48
    case = cases(model)[0]
    with running_engine(model) as eng:
        want = run(eng, case["prompt_ids"], max_new_tokens=n_new, ignore_eos=True,
                   speculative=False).token_ids
    for in_full in (False, True):
        with running_engine(model, verify_width=16, drafter="ngram", tree_budget=8,
                            draft_in_full=in_full) as eng:
            eng.drafter = WrongDrafter({tuple(case["prompt_ids"]): want[1:]},
                                       eng.spec.vocab_size)
            if not in_full:
                eng.verify_alpha, eng.draft_cost = 0.5, 0.0   # the price, not this machine's
            out = run(eng, case["prompt_ids"], max_new_tokens=n_new, ignore_eos=True)
            assert out.token_ids == want, in_full
            u = out.finished.usage
            assert u.accepted_draft_tokens == 0
            trees = u.draft_tokens / 7                    # 7 drafted nodes a tree
            if in_full:
                assert trees >= n_new - 8, u          # (the last steps have less room)
            else:
                every = eng.scheduler.probe_every()
                assert 1 <= trees <= 1 + n_new // every, (u, every)
                # the next request starts from what the first one's trees showed: no first tree
                again = run(eng, case["prompt_ids"], max_new_tokens=n_new, ignore_eos=True)
                assert again.token_ids == want
                assert again.finished.usage.draft_tokens / 7 <= n_new // every, again.finished
