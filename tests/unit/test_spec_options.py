"""Per-request speculative options resolved against the server's configuration: defaults,
narrowing within the limits, and every refusal naming its field with the right status."""

from __future__ import annotations

import pytest

from service.config import EngineConfig
from service.engine.spec.options import Speculation, resolve
from service.engine.types import SpeculativeOptions as Opts
from service.errors import InvalidRequestError

CHAIN = EngineConfig(verify_width=6, tree_budget=0)
TREE = EngineConfig(verify_width=6, tree_budget=12)
NONE = EngineConfig(drafter="none", verify_width=1)


@pytest.mark.parametrize(("enabled", "opts", "cfg", "want"), [
    (None, Opts(), CHAIN, Speculation(True, 6, 0)),               # the server's defaults
    (None, Opts(), TREE, Speculation(True, 6, 12)),
    (True, Opts(), CHAIN, Speculation(True, 6, 0)),
    (None, Opts(width=2), CHAIN, Speculation(True, 2, 0)),
    (None, Opts(width=6), CHAIN, Speculation(True, 6, 0)),
    (None, Opts(mode="chain"), TREE, Speculation(True, 6, 0)),     # chain on a tree server
    (None, Opts(mode="chain", width=3), TREE, Speculation(True, 3, 0)),
    (None, Opts(mode="tree"), TREE, Speculation(True, 6, 12)),
    (None, Opts(tree_budget=5), TREE, Speculation(True, 6, 5)),    # a budget selects tree
    (True, Opts(mode="tree", tree_budget=2, width=4), TREE, Speculation(True, 4, 2)),
    (False, Opts(), TREE, Speculation(False, 6, 0)),
    (None, Opts(mode="off"), TREE, Speculation(False, 6, 0)),
    (False, Opts(mode="off"), CHAIN, Speculation(False, 6, 0)),
    (None, Opts(), NONE, Speculation(False, 1, 0)),                # no drafter: plain
    (False, Opts(), NONE, Speculation(False, 1, 0)),
    (None, Opts(mode="off"), NONE, Speculation(False, 1, 0)),
])
def test_resolved(enabled, opts, cfg, want):
    assert resolve(enabled, opts, cfg, cfg.drafter != "none") == want


@pytest.mark.parametrize(("enabled", "opts", "cfg", "field", "reason"), [
    (None, Opts(width=7), CHAIN, "speculative.width", "INVALID_ARGUMENT"),
    (None, Opts(width=1), CHAIN, "speculative.width", "INVALID_ARGUMENT"),
    (None, Opts(width=0), TREE, "speculative.width", "INVALID_ARGUMENT"),
    (None, Opts(tree_budget=13), TREE, "speculative.tree_budget", "INVALID_ARGUMENT"),
    (None, Opts(tree_budget=1), TREE, "speculative.tree_budget", "INVALID_ARGUMENT"),
    (None, Opts(mode="chain", tree_budget=4), TREE, "speculative.tree_budget",
     "INVALID_ARGUMENT"),
    (None, Opts(mode="sideways"), CHAIN, "speculative.mode", "INVALID_ARGUMENT"),
    (False, Opts(mode="chain"), CHAIN, "speculative.mode", "INVALID_ARGUMENT"),
    (False, Opts(mode="tree"), TREE, "speculative.mode", "INVALID_ARGUMENT"),
    (True, Opts(mode="off"), CHAIN, "speculative.mode", "INVALID_ARGUMENT"),
    (None, Opts(mode="off", width=3), CHAIN, "speculative.width", "INVALID_ARGUMENT"),
    (False, Opts(tree_budget=3), TREE, "speculative.tree_budget", "INVALID_ARGUMENT"),
    (None, Opts(mode="tree"), CHAIN, "speculative.mode", "FAILED_PRECONDITION"),
    (None, Opts(tree_budget=4), CHAIN, "speculative.tree_budget", "FAILED_PRECONDITION"),
    (True, Opts(), NONE, "speculative.enabled", "FAILED_PRECONDITION"),
    (None, Opts(mode="chain"), NONE, "speculative.mode", "FAILED_PRECONDITION"),
    (None, Opts(width=2), NONE, "speculative.width", "FAILED_PRECONDITION"),
    (None, Opts(tree_budget=2), NONE, "speculative.tree_budget", "FAILED_PRECONDITION"),
])
def test_refused(enabled, opts, cfg, field, reason):
    with pytest.raises(InvalidRequestError) as e:
        resolve(enabled, opts, cfg, cfg.drafter != "none")
    assert (e.value.field, e.value.reason) == (field, reason), str(e.value)
    assert str(e.value).startswith(field + ": ")


def test_a_server_with_verify_width_1_cannot_speculate():
    cfg = EngineConfig(drafter="ngram", verify_width=1)
    assert resolve(None, Opts(), cfg, True) == Speculation(False, 1, 0)
    with pytest.raises(InvalidRequestError) as e:
        resolve(True, Opts(), cfg, True)
    assert e.value.reason == "FAILED_PRECONDITION" and "verify_width=1" in str(e.value)


def test_a_repetition_penalty_verifies_chains():
    """The penalty reads the token history by position, which a tree's siblings share: the
    server's default tree falls back to chain; asking for a tree with a penalty is refused."""
    assert resolve(None, Opts(), TREE, True, 1.3) == Speculation(True, 6, 0)
    assert resolve(None, Opts(), TREE, True, 1.0) == Speculation(True, 6, 12)
    for opts, field in ((Opts(mode="tree"), "speculative.mode"),
                        (Opts(tree_budget=4), "speculative.tree_budget")):
        with pytest.raises(InvalidRequestError) as e:
            resolve(None, opts, TREE, True, 1.3)
        assert e.value.field == field and "repetition_penalty" in str(e.value)


def test_frequency_and_presence_penalties_verify_chains_too():
    """They count the generated tokens in the token history by position, as the repetition
    penalty reads its window: the default tree falls back to chain; asking for one is refused
    with the penalty named."""
    assert resolve(None, Opts(), TREE, True, 1.0, True) == Speculation(True, 6, 0)
    with pytest.raises(InvalidRequestError) as e:
        resolve(None, Opts(mode="tree"), TREE, True, 1.0, True)
    assert e.value.field == "speculative.mode" and "frequency_penalty" in str(e.value)
