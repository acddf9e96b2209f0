"""bench/concurrency.py: the goals from a run's own rows, the EngineConfig fields it passes (only
the options given), the prompt id pool, and one short run through the real server on a tiny
synthetic model. Nothing here asserts a speed."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def C():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))            # concurrency.py imports server_overhead
    return importlib.import_module("concurrency")


def _row(n: int, agg: float, itl99: float, ttft99: float = 100.0) -> dict:
    return {"streams": n, "agg_tok_s": agg, "itl_p99_ms": itl99, "ttft_p99_ms": ttft99}


def test_goals_against_the_one_stream_row(C):
    rows = [_row(1, 100.0, 10.0), _row(8, 199.0, 30.0), _row(16, 1000.0, 20.0, 500.0),
            _row(64, 2400.0, 50.0, 1000.1)]
    cpu = {g["goal"]: g for g in C.goals(rows, "cpu")}
    assert cpu["16 streams: aggregate >= 10x one stream's"]["met"]          # exactly 10x
    assert cpu["16 streams: p99 ITL <= 2x one stream's"]["met"]             # exactly 2x
    assert not cpu["64 streams: aggregate >= 25x one stream's"]["met"]      # 24x
    assert cpu["64 streams: aggregate >= 25x one stream's"]["value"] == pytest.approx(24.0)
    assert not cpu["8 streams: aggregate >= 2x one stream's"]["met"]        # 1.99x
    assert cpu["16 streams joining at once: TTFT p99 <= 500 ms"]["met"]      # exactly 500 ms
    cuda = {g["goal"]: g for g in C.goals(rows, "cuda")}
    assert not any(g.startswith("8 streams") for g in cuda) and len(cuda) == 4
    assert not cuda["64 streams joining at once: TTFT p99 <= 1000 ms"]["met"]
    assert C.goals(rows[1:], "cpu") == []                  # no 1-stream row, no ratio


def test_engine_fields_hold_only_the_options_given(C):
    a = C.parse_args(["--levels", "4,1", "--tokens", "100", "--prefix-tokens", "300"])
    f = C.engine_fields(a, "cpu", [1, 4, 8])
    assert f == {"backend": "cpu", "n_ctx": 300 + C.SUFFIX_TOKENS + 1 + 64, "n_slots": 8,
                 "threads": 0}
    a = C.parse_args(["--kv-cache-memory", "0.5", "--max-step-tokens", "512",
                      "--prefill-chunk", "64", "--no-prefix-cache", "--n-ctx", "4096",
                      "--n-slots", "3", "--prefix-tokens", "0"])
    f = C.engine_fields(a, "cuda", a.level_list)
    assert a.level_list == [1, 4, 16, 64]
    assert f == {"backend": "cuda", "n_ctx": 4096, "n_slots": 3, "threads": 0,
                 "kv_cache_memory": "0.5", "max_step_tokens": 512, "prefill_chunk": 64,
                 "prefix_cache": False}
    # the segmented steps' A/B baseline is the scheduler's, not a config field
    a = C.parse_args(["--one-prompt-a-step"])
    assert a.one_prompt_a_step and "one_prompt_a_step" not in C.engine_fields(a, "cpu", [1])


def test_short_run_on_a_tiny_synthetic_model(C, tmp_path):
    out = tmp_path / "c.json"
    assert C.main(["--model", "synth-tiny", "--synth-dir", str(tmp_path), "--levels", "1",
                   "--tokens", "4", "--prefix-tokens", "40", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["streams"] for r in res["rows"]] == [1, 8]         # level 8 added on the CPU
    assert [r["tokens"] for r in res["rows"]] == [4, 32]
    assert res["config"]["prompts"] == "ids" and res["config"]["engine"]["n_slots"] == 8
    p = res["prefix"]
    assert p["prefix_tokens"] == 40 and len(p["rounds"]) == C.PREFIX_ROUNDS
    assert p["cached_a"] <= p["cached_b"] <= 40 + C.SUFFIX_TOKENS
    assert [g["goal"] for g in res["goals"]] == ["8 streams: aggregate >= 2x one stream's",
                                                 "cached TTFT <= 1/10 uncached"]
    for row in res["rows"]:         # the per-iteration profile of each level
        prof = row["profile"]
        assert prof["steps"] >= row["tokens"] // row["streams"] - 1 and prof["iterations"] >= 1
        parts = sum(prof[k] for k in ("schedule", "draft", "pack", "step", "readback", "emit",
                                      "other", "idle"))
        assert prof["step"] > 0 and prof["emit"] > 0 and prof["pack"] > 0
        host = sum(prof[k] for k in ("schedule", "draft", "pack", "emit", "other"))
        assert abs(prof["host"] - host) < 1e-6 and 0 < prof["host_cpu"] and prof["step_cpu"] > 0
        assert prof["hops"] >= 1    # the streams' events reached the event loop
        assert parts * prof["iterations"] <= (prof["wall_s"] * 1.05 + 0.05) * 1e3
        # CPU seconds in clock ticks (10 ms, rounded per thread): a tiny level may take none
        assert all(prof[k] >= 0 for k in ("engine_cpu_s", "grpc_loop_cpu_s", "grpc_core_cpu_s",
                                          "clients_cpu_s", "pool_cpu_s"))


def test_prompt_ids_are_ordinary_tokens(C, tmp_path):
    from synth_model import synth_model

    from service.gguf.reader import GGUFFile
    from service.model.tokenizer import TokenAttr, Tokenizer

    path, _ = synth_model(tmp_path, "tiny")
    tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
    pool = C.ordinary_ids(tok)
    assert 0 < len(pool) < tok.vocab_size
    assert tok.bos_id not in pool and tok.eos_id not in pool
    assert all(tok.token_attr(int(i)) == TokenAttr.NORMAL for i in pool)


def _run(C, t0: float, stamps: list[float], sizes: list[int], prompt: int = 10):
    r = C.TokenRun()
    r.t0, r.stamps, r.sizes, r.prompt_tokens = t0, stamps, sizes, prompt
    r.tokens = sum(sizes)
    return r


def test_steady_counts_only_tokens_while_every_stream_decodes(C):
    # stream a: first token at 1.0, b at 2.0 (the window opens), a ends at 5.0 (it closes)
    a = _run(C, 0.0, [1.0, 2.0, 3.0, 4.0, 5.0], [1, 1, 1, 1, 1])
    b = _run(C, 0.0, [2.0, 2.5, 3.5, 4.5, 6.0], [1, 2, 2, 1, 1])
    s = C.steady([a, b])
    # in (2, 5]: a's 3.0, 4.0, 5.0 (3 tokens) and b's 2.5, 3.5, 4.5 (5 tokens) over 3 s
    assert s["steady_s"] == pytest.approx(3.0)
    assert s["steady_tok_s"] == pytest.approx(8 / 3.0)
    assert s["prompt_tok_s"] == pytest.approx(20 / 2.0)        # 2 prompts by the last first token
    # a stream that ended before the last one started: no window
    late = _run(C, 0.0, [7.0, 8.0], [1, 1])
    assert C.steady([a, late])["steady_tok_s"] != C.steady([a, late])["steady_tok_s"]   # NaN
    assert C.steady([a, late])["steady_s"] == 0.0


BATCHED = """
main: n_kv_max = 20000, n_batch = 2048, n_ubatch = 512, flash_attn = 1
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.039 |  3241.82 |    0.485 |   263.77 |    0.525 |   487.85 |
|   128 |    128 |   64 |  16384 |    0.800 | 10240.17 |    1.857 |  4412.15 |    2.657 |  6167.10 |

llama_perf_context_print:        load time =    1234.56 ms
"""


def test_llama_batched_bench_table_and_the_goal_against_it(C):
    got = C.parse_batched_bench(BATCHED)
    assert sorted(got) == [1, 64]
    assert got[64]["S_TG"] == 4412.15 and got[64]["S_PP"] == 10240.17 and got[1]["T"] == 0.525
    rows = [{"streams": 1, "steady_tok_s": 300.0}, {"streams": 64, "steady_tok_s": 6618.3}]
    goal = C.llamacpp_goals(rows, got)
    assert len(goal) == 1 and goal[0]["met"]                        # 1.5000x
    rows[1]["steady_tok_s"] = 6600.0
    assert not C.llamacpp_goals(rows, got)[0]["met"]
    assert C.llamacpp_goals(rows, {}) == [] and C.parse_batched_bench("no table") == {}
