"""The suffix drafter: its index and cache (pure), and identity through the engine."""

from __future__ import annotations

import pytest

from service.config import EngineConfig
from service.engine.scheduler.policy import PROBE_EVERY
from service.engine.spec.drafters import Drafter, SlotView, create_drafter
from service.engine.spec.suffix import SuffixCache, SuffixDrafter
from service.engine.types import SamplingParams
from tests.engine.test_spec_sampling import SAMPLED, compare, engine, smol_prompts
from tests.support.engines import run, running_engine


def test_longest_match_then_most_frequent_continuation():
    d = SuffixDrafter(max_depth=4, min_match=1, cache_tokens=0)
    # [5, 1, 2] unseen; after [1, 2]: 3 twice, 4 once -> 3; after [1, 2, 3]: 9; after
    # [2, 3, 9]: 7 once and 5 once, a tie -> the smaller id
    hist = [1, 2, 3, 9, 7, 1, 2, 4, 8, 1, 2, 3, 9, 5, 1, 2]
    assert d.propose(SlotView(0, hist), 3) == [3, 9, 5]
    # a longer context overrides a more frequent short one: [5, 1, 2] was followed by 4
    hist = [1, 2, 3, 1, 2, 3, 5, 1, 2, 4, 0, 5, 1, 2]
    assert d.propose(SlotView(1, hist), 1) == [4]
    assert d.propose(SlotView(2, [1, 2, 3, 4]), 2) == []          # no earlier context
    assert SuffixDrafter(4, 2, 0).propose(SlotView(0, [7, 1, 9, 1]), 2) == []  # 1 < min_match


def test_incremental_index_equals_a_fresh_one():
    inc = SuffixDrafter(max_depth=5, min_match=2, cache_tokens=0)
    hist = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for n in range(2, len(hist) + 1):
        fresh = SuffixDrafter(max_depth=5, min_match=2, cache_tokens=0)
        assert inc.propose(SlotView(0, hist[:n]), 4) == fresh.propose(SlotView(0, hist[:n]), 4)
    # a different history in the same slot (after start) is indexed afresh
    inc.start(SlotView(0, [8, 8]))
    assert inc.propose(SlotView(0, [1, 2, 7, 1, 2]), 1) == [7]


def test_cache_drafts_other_requests_and_evicts_lru_by_tokens():
    d = SuffixDrafter(max_depth=4, min_match=2, cache_tokens=12)
    d.release(SlotView(0, [10, 11, 12, 13, 14, 15]))               # 6 tokens cached
    assert d.propose(SlotView(1, [0, 10, 11]), 3) == [12, 13, 14]
    d.release(SlotView(1, [20, 21, 22, 23, 24, 25, 26]))           # 13 > 12: the first goes
    assert d.cache.tokens == 7
    assert d.propose(SlotView(2, [0, 10, 11]), 3) == []
    assert d.propose(SlotView(2, [5, 21, 22]), 2) == [23, 24]
    d.release(SlotView(3, list(range(100, 120))))                  # longer than the cache: kept out
    assert d.cache.tokens == 7
    # eviction removes exactly what the history added
    c = SuffixCache(8, 3)
    c.add([1, 2, 3, 4])
    c.add([5, 6, 7, 8, 9])
    assert c.index and all(1 not in k and 4 not in k for k in c.index)
    assert all(v > 0 for cnt in c.index.values() for v in cnt.values())


def test_config_and_factory():
    assert isinstance(create_drafter("suffix", 3, 100), SuffixDrafter)
    assert create_drafter("suffix", 3, 100).cache.max_tokens == 100
    assert EngineConfig(drafter="suffix").problems() == []
    assert [f for f, _ in EngineConfig(suffix_cache_tokens=-1).problems()] == [
        "suffix_cache_tokens"]
    with pytest.raises(ValueError):
        SuffixDrafter(max_depth=2, min_match=3)


def test_greedy_and_sampled_identity_smollm2():
    with engine("smollm2", drafter="suffix", verify_width=8) as eng:
        configs = {"greedy": SamplingParams(temperature=0.0),
                   "t0.8-penalty": SAMPLED["t0.8-penalty"]}
        drafted, accepted = compare(eng, smol_prompts()[:1], configs)
        print(f"\nsuffix, smollm2: {accepted}/{drafted} drafts accepted")
        assert accepted > 0


def test_greedy_and_sampled_identity_tiny():
    with engine("tiny-qwen3", drafter="suffix", verify_width=6) as eng:
        prompts = [[1, 5, 9, 20, 5, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11], [700, 2, 700, 2]]
        configs = {"greedy": SamplingParams(temperature=0.0), **SAMPLED}
        drafted, accepted = compare(eng, prompts, configs)
        assert drafted > 0


def test_cache_helps_a_repeated_request():
    """The same prompt twice: the second run drafts from the first's cached output."""
    with engine("smollm2", drafter="suffix", verify_width=6) as eng:
        ids = eng.text_prompt_ids("Write a short story about a lighthouse keeper who finds")
        kw = {"max_new_tokens": 40, "ignore_eos": True}
        first = run(eng, ids, speculative=True, **kw)
        second = run(eng, ids, speculative=True, **kw)
        assert second.token_ids == first.token_ids
        a1 = first.finished.usage.accepted_draft_tokens
        a2 = second.finished.usage.accepted_draft_tokens
        print(f"\naccepted drafts: first {a1}, repeated {a2}")
        assert a2 > a1 + 10


class _Junk(Drafter):
    """Always proposes k tokens that the model is unlikely to choose."""

    name = "junk"

    def propose(self, seq, k):
        return [(seq.history[-1] * 7 + 13 + i) % 97 + 3 for i in range(k)]


def test_width_policy_stops_drafting_without_repetition():
    """A drafter that keeps missing: after a few verifies the policy decodes plainly, with one
    probe draft every PROBE_EVERY plain steps; the output is plain decoding's."""
    n = 48
    with running_engine("tiny-qwen3", verify_width=6) as eng:
        eng.speculator.drafter = _Junk()
        eng.verify_alpha = 0.3
        kw = {"max_new_tokens": n, "ignore_eos": True}
        plain = run(eng, [3, 17, 42, 5, 88, 21, 9], speculative=False, **kw)
        spec = run(eng, [3, 17, 42, 5, 88, 21, 9], speculative=True, **kw)
        assert spec.token_ids == plain.token_ids
        u = spec.finished.usage
        assert u.accepted_draft_tokens < 0.2 * u.draft_tokens
        # a few full-width tries at the prior, then probes of one draft
        assert u.draft_tokens <= 4 * 5 + n // PROBE_EVERY + 1, u.draft_tokens
