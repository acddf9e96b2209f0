"""The model drafter's chain as one backend step (Transformer.forward_chain) on the CPU with the
capture rules on: the same drafts, log-probabilities and draft KV rows as the chain run step by
step, for several draft lengths, over rounds of partial acceptance, with and without a Markov
head; one step per chain length; forward_chain refuses mismatched inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.backends import create_backend
from service.engine.spec.draft_model import ModelDrafter
from service.engine.spec.markov_head import load_markov_head
from service.gguf.reader import GGUFFile
from service.tools.fit_markov import write_head
from tests.engine.test_model_drafter import _State
from tests.support.models import build_model, load_json

V = 49152                        # SmolLM2's vocabulary
M = 8                            # draft workspace rows: the prompt is caught up in 3 chunks
LENGTHS = (2, 5, 8)              # draft lengths k (chains of 1, 4 and 7 forwards)


def make_draft_files(plain: Path, d: Path) -> dict[str, Path]:
    """`plain` (SmolLM2's first 4 blocks at q8_0), and a copy of it in directory d with a
    random rank-16 F16 head strong enough to move argmaxes (as in the Markov head tests)."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((V, 16)).astype(np.float32)                # (V, 16) f32
    w2 = (rng.standard_normal((V, 16)) * 4.0 / np.sqrt(16)).astype(np.float32)
    headed = d / "smol-4l-head.gguf"
    write_head(GGUFFile(plain), headed, w1, w2, "f16")
    return {"plain": plain, "head": headed}


@pytest.fixture(scope="module")
def draft_files(requantized, tmp_path_factory) -> dict[str, Path]:
    return make_draft_files(requantized("smollm2", "q8_0", 4), tmp_path_factory.mktemp("chain"))


def drafter_on(be, path: Path, head: bool) -> ModelDrafter:
    """A drafter of file `path` on backend `be` (its own), 2 slots, M-row steps."""
    h = load_markov_head(GGUFFile(path), V, be) if head else None   # before the model's prepare
    assert (h is not None) == head
    model = build_model(path, be, n_ctx=96, n_slots=2, max_tokens=M, max_logits=1)
    return ModelDrafter(model, path.name, h)


def _drafter(path: Path, head: bool) -> ModelDrafter:
    """A drafter on a CPU backend with the capture rules on."""
    return drafter_on(create_backend("cpu", capture_rules=True, invariant_tokens=16), path, head)


def draft(d: ModelDrafter, seq: _State, k: int, one_step: bool, n_top: int):
    d.one_step_chain = one_step
    if n_top:
        return d.candidates(seq, k, n_top)
    return d.propose(seq, k), None, None


@pytest.mark.parametrize("n_top", [0, 3], ids=["ids", "candidates"])
@pytest.mark.parametrize("which", ["plain", "head"])
def test_the_one_step_chain_equals_the_chain_step_by_step(draft_files, which, n_top):
    """Slot 0 drafts with the one-step chain, slot 1 step by step, from the same history; over
    rounds where the target accepts a part of the drafts and then differs, every draft, every
    candidate and every log-probability agree exactly (so do the kept draft KV rows, which
    the next round's drafts read)."""
    d = _drafter(draft_files[which], which == "head")
    state = d.model.backend.capture_state
    prompt = load_json("llamacpp_smollm2_greedy.json")["cases"][1]["prompt_ids"]   # 18 ids
    one, ref = _State(0, list(prompt)), _State(1, list(prompt))
    d.start(one)
    d.start(ref)
    for r in range(6):
        k = LENGTHS[r % len(LENGTHS)]
        steps = state.steps
        got = draft(d, one, k, True, n_top)
        one_step_steps = state.steps - steps
        want = draft(d, ref, k, False, n_top)
        assert len(want[0]) == k and got[0] == want[0], (r, k)
        if n_top:
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[2], want[2])
            assert got[1].shape == (k, n_top) and (got[1][:, 0] == got[0]).all()
        # catch-up chunks (3 for the prompt, 1 later) and then the whole chain as one step
        assert one_step_steps == (3 if r == 0 else 1) + 1, (r, one_step_steps)
        assert (1, 1, "chain", k - 1) in state.sequences
        accept_part([one, ref], got[0], r)
    assert one.history == ref.history


def accept_part(seqs: list[_State], drafts: list[int], r: int) -> None:
    """Round r's verdict: the target accepts r % k of the k drafts, then picks another token
    than the next draft (so the drafter keeps some of its chain's rows and rewrites others)."""
    j = r % len(drafts)
    nxt = (drafts[j] + 1 + r) % V
    for seq in seqs:
        seq.history += [*drafts[:j], nxt]


def test_forward_chain_checks_its_inputs(draft_files):
    d = _drafter(draft_files["plain"], False)
    ids = d.model.backend.zeros((3,), "int32")                          # (3,) i32
    with pytest.raises(ValueError, match="chain of 3 steps"):
        d.model.forward_chain(ids, ids[:2], ids, [1, 2, 3], lambda i, lg: None)
    with pytest.raises(ValueError, match="chain of 0 steps"):
        d.model.forward_chain(ids[:0], ids[:0], ids[:0], [], lambda i, lg: None)
