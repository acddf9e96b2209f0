"""Prometheus metrics on their own port; the client CLI end to end."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from clients.cli import main as client_main


def scrape(server) -> str:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def value(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + labels + r"[^}]*\}" if labels else r"(\{[^}]*\})?")
    m = re.search("^" + pattern + r" ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"{name} {labels} not in metrics"
    return float(m.group(m.lastindex))


def test_metrics_count_requests_tokens_latency_and_speculation(server, client):
    before = scrape(server)
    tokens_before = value(before, "specstream_completion_tokens_total")
    prompt = "1 2 3 4 1 2 3 4 1 2 3 4 1 2 3 4 1 2 3"      # the n-gram drafter finds drafts here
    done = client.complete(prompt, max_new_tokens=8, ignore_eos=True, temperature=0.0)
    after = scrape(server)
    assert value(after, "specstream_completion_tokens_total") - tokens_before == 8
    assert value(after, "specstream_rpcs_total",
                 'code="OK",method="/specstream.v1.GenerationService/Generate"') >= 1
    for name in ("specstream_time_to_first_token_seconds_count",
                 "specstream_time_per_output_token_seconds_count",
                 "specstream_queue_time_seconds_count", "specstream_prompt_tokens_total"):
        assert value(after, name) >= 1, name
    assert value(after, "specstream_queue_depth") == 0
    assert value(after, "specstream_generate_requests_total", 'reason="length"') >= 1
    if done.usage.draft_tokens:
        assert value(after, "specstream_draft_tokens_total") >= done.usage.draft_tokens
        assert value(after, "specstream_speculative_acceptance_ratio_count") >= 1


def test_metrics_show_the_prefix_cache_and_the_kv_pool(server, client):
    """The second request with the same 40-token prefix reuses its whole blocks: its Usage and
    the prefix-cache counter say how many tokens; the pool gauges add up to the pool."""
    before = value(scrape(server), "specstream_prefix_cache_tokens_total")
    prefix = " ".join(f"w{i}" for i in range(40))
    first = client.complete(prefix + " tail one", max_new_tokens=2, temperature=0.0)
    second = client.complete(prefix + " tail two", max_new_tokens=2, temperature=0.0)
    assert first.usage.cached_prompt_tokens == 0 or before > 0   # an earlier test may have it
    assert second.usage.cached_prompt_tokens >= 16
    text = scrape(server)
    got = value(text, "specstream_prefix_cache_tokens_total") - before
    assert got == first.usage.cached_prompt_tokens + second.usage.cached_prompt_tokens
    blocks = {s: value(text, "specstream_kv_cache_blocks", f'state="{s}"')
              for s in ("used", "cached", "free")}
    assert blocks["cached"] >= second.usage.cached_prompt_tokens / 16
    assert sum(blocks.values()) == server.engine.pool.n_blocks
    assert value(text, "specstream_preemptions") == 0


def test_client_cli_generate_streams_text(server, client, capsys):
    rc = client_main(["--target", server.target, "generate", "The capital of France is",
                      "-n", "6", "--temperature", "0", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0
    expected = client.complete("The capital of France is", max_new_tokens=6, ignore_eos=True,
                               temperature=0.0).text
    assert out == expected + "\n"
    assert "finish=LENGTH" in err and "completion=6" in err


def test_client_cli_generate_json_and_chat(server, capsys):
    rc = client_main(["--target", server.target, "generate", "Say hi", "--chat", "-n", "3",
                      "--temperature", "0", "--json"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and "started" in lines[0] and "finished" in lines[-1]


def test_client_cli_info_tokenize_detokenize_config(server, capsys):
    assert client_main(["--target", server.target, "info"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 49152
    assert client_main(["--target", server.target, "tokenize", "hello world", "--json",
                        "--no-add-bos"]) == 0
    ids = json.loads(capsys.readouterr().out)["ids"]
    assert client_main(["--target", server.target, "detokenize", *map(str, ids)]) == 0
    assert capsys.readouterr().out == "hello world\n"
    assert client_main(["--target", server.target, "config"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "cpu"
    assert client_main(["--target", server.target, "health"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_client_cli_validate_config(server, capsys):
    rc = client_main(["--target", server.target, "validate-config", "--cache-type-k", "q4_k",
                      "--verify-width", "99"])
    out = capsys.readouterr().out
    assert rc == 1 and "invalid (2 problems)" in out
    assert "known types: f16, bf16, q8_0" in out and "1..16" in out
    assert client_main(["--target", server.target, "validate-config", "--verify-width",
                        "8"]) == 0
    assert capsys.readouterr().out.strip() == "valid"


@pytest.mark.parametrize("argv", [["generate", "hi", "--temperature", "-1"],
                                  ["detokenize", "999999"]])
def test_client_cli_errors_name_the_field(server, capsys, argv):
    assert client_main(["--target", server.target, *argv]) == 1
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "field " in err
