"""bench/cpu_decode.py's tables: a ratio only against a llama.cpp figure measured in the run.

The table functions run on hand-made rows; nothing here times anything or runs the benchmark.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cpu_decode.py"
RATIO = re.compile(r"\d+\.\d\dx")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_decode_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _decode_rows(ref: float | None) -> list[dict]:
    return [{"model": "smollm2-135m", "prompt": "prose", "specstream": 40.0,
             "specstream_spec": 50.0, "llama_cpp": ref},
            {"model": "gemma3-270m", "prompt": "code", "specstream": 20.0,
             "specstream_spec": 30.0, "llama_cpp": ref}]


def test_without_llamacpp_no_baseline_and_no_ratio(bench):
    decode = bench.decode_table(_decode_rows(None), 64, 2, 3)
    prefill = bench.prefill_table([{"model": "smollm2-135m", "specstream": 300.0,
                                    "llama_cpp": None}], 512, 2)
    for table in (decode, prefill):
        body = table.splitlines()[3:-1]           # after the title and header, before the note
        assert body and not any(RATIO.search(line) for line in body), table
        assert table.splitlines()[-1] == bench.NOT_MEASURED
        assert "not importable" in bench.NOT_MEASURED
        numbers = {float(x) for x in re.findall(r"(\d+\.\d)/s", table)}
        assert numbers <= {40.0, 50.0, 20.0, 30.0, 300.0}   # only what this run measured


def test_with_llamacpp_ratio_is_against_the_measured_figure(bench):
    decode = bench.decode_table(_decode_rows(80.0), 64, 2, 3)
    assert bench.NOT_MEASURED not in decode
    lines = decode.splitlines()
    assert RATIO.findall(lines[3]) == [f"{40 / 80:.2f}x", f"{50 / 80:.2f}x"]
    assert RATIO.findall(lines[4]) == [f"{20 / 80:.2f}x", f"{30 / 80:.2f}x"]
    prefill = bench.prefill_table([{"model": "gemma3-270m", "specstream": 300.0,
                                    "llama_cpp": 200.0}], 512, 2)
    assert RATIO.findall(prefill) == [f"{300 / 200:.2f}x"]
