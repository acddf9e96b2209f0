"""train-drafter's bookkeeping (service/tools/eagle3_fit.py, eagle3_data.py, train_drafter.py):
the draft vocabulary, the head rows and their per-unroll-step weights, the acceptance start
rows, the prompt corpus and split, the learning-rate schedule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.errors import ConfigError
from service.model.tokenizer import Tokenizer
from service.tools.eagle3_data import PROMPTS, TargetSequence, prompt_ids, read_prompts
from service.tools.eagle3_fit import (
    acceptance_starts,
    draft_vocab,
    make_batch,
    schedule,
    soft_labels,
    target_to_draft,
)
from service.tools.train_drafter import split


def sequence(ids, n_prompt, choice) -> TargetSequence:
    """ids (T,), choice (T - 1,): the target's argmax at positions 0..T-2; features = position."""
    T = len(ids)
    feats = np.arange(T - 1, dtype=np.float32)[:, None].repeat(3, 1)
    return TargetSequence(np.array(ids), n_prompt, feats, np.array(choice))


def test_the_draft_vocabulary_is_the_most_frequent_labels_sorted():
    # labels are choice[1:]: 7 x3, 2 x2, 5 x2, 9 x1 (choice[0] = 9 is no row's label)
    s = sequence([0] * 10, 2, [9, 7, 5, 7, 2, 5, 7, 2, 9])
    assert draft_vocab([s], 12, 0) is None
    assert draft_vocab([s], 12, 1).tolist() == [7]
    assert draft_vocab([s], 12, 3).tolist() == [2, 5, 7]        # 2 and 5 tie: both in
    assert draft_vocab([s], 12, 2).tolist() == [2, 7]           # the tie goes to the lower id
    assert draft_vocab([s], 12, 6).tolist() == [0, 1, 2, 5, 7, 9]   # then unseen ids, lowest
    t2d = target_to_draft(np.array([2, 7]), 12)
    assert t2d.tolist() == [-1, -1, 0, -1, -1, -1, -1, 1, -1, -1, -1, -1]
    assert target_to_draft(None, 4).tolist() == [0, 1, 2, 3]


def test_soft_labels_are_the_top_tokens_on_the_draft_vocabulary_renormalized():
    """Row P's soft label is position P + 1's top tokens (the label's position) mapped to
    draft ids, those outside the draft vocabulary and unset entries dropped, the rest
    renormalized; a batch carries them padded with probability 0."""
    ids, choice = [1, 2, 3, 4, 5], [2, 3, 4, 5]
    top = np.array([[2, 6, -1], [3, 8, 6], [4, 9, 3], [5, 6, 2]])             # (T - 1, 3)
    logp = np.log(np.array([[0.5, 0.1, 1.0], [0.6, 0.2, 0.1], [0.7, 0.3, 1e-30],
                            [0.8, 0.1, 0.1]], np.float32))
    logp[0, 2] = -np.inf
    s = TargetSequence(np.array(ids), 2, np.zeros((4, 3), np.float32), np.array(choice),
                       top, logp)
    t2d = target_to_draft(np.array([2, 3, 4, 5, 6]), 10)     # 8 and 9 outside
    d, p = soft_labels(s, t2d)
    assert d.shape == p.shape == (3, 3)
    assert np.allclose(p, [[0.6 / 0.7, 0, 0.1 / 0.7], [1.0, 0, 0], [0.8, 0.1, 0.1]])
    assert d[0, 0] == 1 and d[0, 2] == 4 and d[1, 0] == 2 and d[2].tolist() == [3, 4, 0]
    b = make_batch([s, sequence(ids[:4], 2, choice[:3])], t2d, 1, soft=False)
    assert b.soft_p is None
    s2 = TargetSequence(np.array(ids[:4]), 2, np.zeros((3, 3), np.float32),
                        np.array(choice[:3]), top[:3], logp[:3])
    b = make_batch([s, s2], t2d, 1, soft=True)
    assert np.allclose(b.soft_p[0], p) and b.soft_ids[0].tolist() == d.tolist()
    assert np.allclose(b.soft_p[1, 2], 0) and np.allclose(b.soft_p[1, :2], p[:2])


def test_rows_labels_and_chain_weights():
    """Row P reads ids[P + 1] and f[P], labeled choice[P + 1]; step k counts row P when P >= k
    and rows P-k+1..P read tokens the target chose (ids[r + 1] == choice[r])."""
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    choice = [2, 9, 4, 5, 6, 9, 8]          # the target chose ids[r + 1] except at r = 1, 5
    s = sequence(ids, 2, choice)
    b = make_batch([s, sequence(ids[:5], 2, choice[:4])], target_to_draft(None, 10), 3)
    assert b.tokens[0].tolist() == [2, 3, 4, 5, 6, 7]
    assert b.labels[0].tolist() == [9, 4, 5, 6, 9, 8]
    assert b.feats[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    chosen = [1, 0, 1, 1, 1, 0]             # per row P: ids[P + 1] == choice[P]
    assert b.weight[0, 0].tolist() == [1] * 6
    assert b.weight[1, 0].tolist() == [0] + chosen[1:]
    assert b.weight[2, 0].tolist() == [0, 0] + [a * c for a, c in zip(chosen[1:], chosen[2:],
                                                                        strict=False)]
    assert b.weight[0, 1].tolist() == [1, 1, 1, 0, 0, 0]     # padding weighs 0
    assert b.labels[1, 3:].tolist() == [-1] * 3


def test_labels_outside_the_draft_vocabulary_weigh_nothing():
    s = sequence([1, 2, 3, 4, 5], 1, [2, 3, 4, 5])
    b = make_batch([s], target_to_draft(np.array([3, 5]), 8), 1)
    assert b.labels[0].tolist() == [0, -1, 1]
    assert b.weight[0, 0].tolist() == [1, 0, 1]


def test_acceptance_starts_are_the_generated_parts_chain_starts():
    ids = list(range(1, 13))                # 12 tokens: rows 0..9
    choice = [i + 1 for i in ids[:-1]]      # the target chose every next token...
    choice[7] = 0                           # ...but the one after position 7 (row 7 unchosen)
    s = sequence(ids, 4, choice)
    # starts from n_prompt - 2 = 2 to R - depth = 7; P + 1..P + 2 chosen: not P = 5, 6
    assert acceptance_starts(s, 3).tolist() == [2, 3, 4, 7]
    assert acceptance_starts(s, 1).tolist() == list(range(2, 10))


def test_the_shipped_prompts():
    prompts = read_prompts()
    assert len(prompts) >= 200 and len(set(prompts)) == len(prompts)
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    for kind in ("def ", "#include", "User:", "Q:", "1.", "Once upon a time"):
        assert sum(kind in p for p in prompts) >= 1, kind
    assert read_prompts(PROMPTS) == prompts


def test_a_prompts_file_of_strings_and_ids(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('"hello"\n\n[1, 2, 3]\n')
    assert read_prompts(f) == ["hello", [1, 2, 3]]
    ids_only = Tokenizer.ids_only(8)
    assert prompt_ids([[1, 2, 3]], ids_only, 8) == [[1, 2, 3]]
    with pytest.raises(ConfigError, match="no tokenizer"):
        prompt_ids(["hello"], ids_only, 8)
    with pytest.raises(ConfigError, match="outside"):
        prompt_ids([[1, 9]], ids_only, 8)
    for bad, why in (("{", "not JSON"), ("3", "non-empty string"), ("[]", "non-empty"),
                     ('[1, "a"]', "list of token ids"), ("", "no prompt")):
        f.write_text(bad + "\n")
        with pytest.raises(ConfigError, match=why):
            read_prompts(f)
    with pytest.raises(ConfigError, match="is not a file"):
        read_prompts(tmp_path / "none.jsonl")
    assert json.loads(PROMPTS.read_text().splitlines()[0])


def test_the_split_is_a_seeded_disjoint_sample():
    tr, ho = split(100, 40, 0.25, seed=3)
    assert (len(tr), len(ho)) == (30, 10) and not set(tr) & set(ho)
    assert (tr == np.sort(tr)).all()
    again = split(100, 40, 0.25, seed=3)
    assert (again[0] == tr).all() and (again[1] == ho).all()
    assert set(split(100, 40, 0.25, seed=4)[1]) != set(ho)
    assert sum(map(len, split(7, 0, 0.3, seed=0))) == 7


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    lrs = [schedule(s, 100, 1.0) for s in range(100)]
    assert lrs[0] == pytest.approx(0.2) and lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    assert lrs[-1] == pytest.approx(0.1 + 0.9 / 95, rel=1e-6)


def test_a_sequence_without_rows_batches_to_zero_weight():
    """A prompt of one token whose first generated token ends it has no head row."""
    b = make_batch([sequence([1, 2], 1, [2])], target_to_draft(None, 4), 2)
    assert b.weight.shape == (2, 1, 1) and b.weight.sum() == 0
    assert acceptance_starts(sequence([1, 2], 1, [2]), 1).tolist() == []
