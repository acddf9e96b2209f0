"""Request validation messages state the range a value must lie in, whatever side it falls off,
and that range is the one the check uses."""

from __future__ import annotations

import re

import pytest

from service.engine.types import MAX_REPEAT_LAST_N, MAX_TOP_K, SamplingParams
from service.errors import InvalidRequestError

U32_MAX = 2**32 - 1      # the largest value a proto uint32 field carries
BOUNDED = [("top_k", MAX_TOP_K), ("repeat_last_n", MAX_REPEAT_LAST_N)]


def refusal(**kw) -> InvalidRequestError | None:
    """The error SamplingParams(**kw).validate() raises, None when it accepts them."""
    try:
        SamplingParams(**kw).validate()
    except InvalidRequestError as e:
        return e
    return None


def stated_range(msg: str) -> tuple[int, int]:
    stated = re.search(r"\[(\d+), (\d+)\]", msg)
    assert stated, msg
    lo, hi = (int(x) for x in stated.groups())
    return lo, hi


@pytest.mark.parametrize("name,bound", BOUNDED)
@pytest.mark.parametrize("over", [1, U32_MAX])
def test_integer_bounds_are_stated(name, bound, over):
    value = bound + over if over == 1 else over
    e = refusal(**{name: value})
    assert e is not None and e.field == f"sampling.{name}"
    msg = str(e)
    lo, hi = stated_range(msg)
    assert (lo, hi) == (0, bound)                 # the range the check really uses
    assert not lo <= value <= hi
    assert msg.endswith(f"got {value}")
    assert ">=" not in msg                        # no one-sided bound the value satisfies


@pytest.mark.parametrize("name,bound", BOUNDED)
def test_stated_bounds_are_accepted(name, bound):
    """Both ends of the stated range pass; one past either end is refused, naming the field
    and stating the same range."""
    below = refusal(**{name: -1})
    assert below is not None and below.field == f"sampling.{name}"
    lo, hi = stated_range(str(below))
    assert (lo, hi) == (0, bound)
    assert refusal(**{name: lo}) is None and refusal(**{name: hi}) is None
    above = refusal(**{name: hi + 1})
    assert above is not None and stated_range(str(above)) == (lo, hi)
