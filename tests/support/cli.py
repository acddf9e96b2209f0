"""The `specstream` command line run in this process, as a test drives it."""

from __future__ import annotations

import json

from tests.support.engines import greedy_with_gaps
from tests.support.models import REAL_MODELS, model_path
from tests.support.near_ties import assert_matches_llamacpp


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`specstream ARGV`: its exit code, stdout and stderr. A known model named in argv is made
    present first (tests.support.models.model_path: fetched, or the test is skipped), and what
    the fetch printed is not part of the command's output."""
    from service.cli import main

    for name in set(argv) & set(REAL_MODELS.values()):
        model_path(name)
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_generate_json_is_the_engines(out: str, engine, model: str, case: dict) -> dict:
    """`generate --json` output for a llama.cpp fixture case of `model`: the case's prompt ids,
    then the greedy ids `engine` gives for them (it also reports each row's top-1/top-2 gap),
    which equal llama.cpp's up to the first near-tie of either side. Returns the parsed output."""
    result = json.loads(out)
    assert result["prompt_ids"] == case["prompt_ids"]
    got, gaps = greedy_with_gaps(engine, case["prompt_ids"], len(result["token_ids"]))
    assert result["token_ids"] == got
    assert_matches_llamacpp(model, case, got, gaps)
    return result
