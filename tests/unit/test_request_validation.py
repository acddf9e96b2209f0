"""Request validation messages state the range a value must lie in, whatever side it falls off."""

from __future__ import annotations

import re

import pytest

from service.engine.types import MAX_REPEAT_LAST_N, MAX_TOP_K, SamplingParams
from service.errors import InvalidRequestError

U32_MAX = 2**32 - 1      # the largest value a proto uint32 field carries


def _message(**kw) -> tuple[str, str]:
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kw).validate()
    return ei.value.field, str(ei.value)


@pytest.mark.parametrize("name,bound", [("top_k", MAX_TOP_K),
                                        ("repeat_last_n", MAX_REPEAT_LAST_N)])
@pytest.mark.parametrize("over", [1, U32_MAX])
def test_integer_bounds_are_stated(name, bound, over):
    value = bound + over if over == 1 else over
    field, msg = _message(**{name: value})
    assert field == f"sampling.{name}"
    stated = re.search(r"\[(\d+), (\d+)\]", msg)
    assert stated, msg
    lo, hi = (int(x) for x in stated.groups())
    assert (lo, hi) == (0, bound)                 # the range the check really uses
    assert not lo <= value <= hi
    assert msg.endswith(f"got {value}")
    assert ">=" not in msg                        # no one-sided bound the value satisfies


@pytest.mark.parametrize("name,bound", [("top_k", MAX_TOP_K),
                                        ("repeat_last_n", MAX_REPEAT_LAST_N)])
def test_stated_bounds_are_accepted(name, bound):
    for value in (0, bound):
        SamplingParams(**{name: value}).validate()
    _message(**{name: -1})
