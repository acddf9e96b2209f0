"""`specstream` CLI: generate --json reproduces llama.cpp's greedy ids; inspect; errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.cli import assert_generate_json_is_the_engines, run_cli
from tests.support.models import TINY, load_json


@pytest.mark.parametrize("fixture,index", [("llamacpp_smollm2_greedy.json", 0),
                                           ("llamacpp_smollm2_greedy_extra.json", 2)])
def test_generate_json_reproduces_llamacpp(capsys, smol, fixture, index):
    """The CLI's ids are the engine's (which also reports each row's top-1/top-2 gap), and
    those equal llama.cpp's up to the first near-tie of either side."""
    case = load_json(fixture)["cases"][index]
    ids = ",".join(str(i) for i in case["prompt_ids"])
    code, out, _ = run_cli(capsys, "generate", "smollm2-135m", "--prompt-ids", ids,
                           "--max-new-tokens", "48", "--temperature", "0", "--json",
                           "--backend", "cpu")
    assert code == 0
    result = assert_generate_json_is_the_engines(out, smol, "smollm2", case)
    assert result["usage"]["completion_tokens"] == len(result["token_ids"])


def test_generate_text_prompt_streams_text(capsys):
    code, out, err = run_cli(capsys, "generate", "smollm2-135m", "--prompt",
                             "The capital of France is", "--max-new-tokens", "3",
                             "--temperature", "0", "--backend", "cpu")
    assert code == 0 and out.startswith(" Paris")
    assert "3 generated tokens" in err


def test_generate_text_ends_with_one_newline(capsys):
    argv = ["generate", "smollm2-135m", "--prompt", "The capital of France is",
            "--max-new-tokens", "5", "--temperature", "0", "--backend", "cpu"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0
    code, as_json, _ = run_cli(capsys, *argv, "--json")
    assert code == 0
    text = json.loads(as_json)["text"]
    assert text and out == text + "\n"           # the streamed text, then one newline
    summary = err.splitlines()[-1]
    assert summary.startswith("[length: ") and "\n\n" not in err   # no blank line before it


def test_bad_kv_type_exits_2_with_the_known_types(capsys):
    code, _, err = run_cli(capsys, "generate", "smollm2-135m", "--prompt", "x",
                           "--cache-type-k", "q4_k", "--verify-width", "0")
    assert code == 2
    assert "unknown KV cache type 'q4_k'" in err and "q5_1, q5_0, q4_1, q4_0" in err
    assert "allowed range is 1..16" in err


def test_kernels_warm_without_cupy_exits_2_with_the_install_line(capsys):
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here: the command would compile")
    code, out, err = run_cli(capsys, "kernels", "warm")
    assert code == 2 and out == ""
    assert "kernels warm: needs CuPy" in err and "pip install" in err


def test_models_list_prints_sizes_in_mib(capsys):
    from service.config import models_dir_from_env

    code, out, _ = run_cli(capsys, "models", "list")
    assert code == 0
    checked = 0
    for line in out.splitlines():
        name = line.split(":")[0].removesuffix(" (default)")
        path = models_dir_from_env() / f"{name}.gguf"
        if not path.is_file():
            continue
        mib = float(re.search(r", (\d+\.\d) MiB \[", line).group(1))
        assert abs(mib - path.stat().st_size / 2**20) <= 0.05, line
        checked += 1
    assert checked, out


def test_readme_model_sizes_are_what_models_list_prints(capsys):
    code, out, _ = run_cli(capsys, "models", "list")
    assert code == 0
    printed = dict(re.findall(r"^([\w.-]+)(?: \(default\))?: .*, (\d+\.\d MiB) \[", out, re.M))
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([\w.-]+)`.*?, (\d+(?:\.\d)? Mi?B) \|", readme, re.M))
    assert rows.keys() == printed.keys() and rows == printed, (rows, printed)


def test_inspect_summarizes_the_model(capsys):
    code, out, _ = run_cli(capsys, "inspect", "smollm2-135m")
    assert code == 0 and "llama" in out and "Q4_1" in out


def test_unknown_model_is_a_clear_error(capsys):
    code, _, err = run_cli(capsys, "generate", "no-such-model", "--prompt", "x")
    assert code == 2 and "smollm2-135m" in err


def test_generate_step_profile(capsys):
    """--step-profile fills the step timings (--json) and adds them to the summary line; the
    debug log holds one step_profile line per decode step."""
    argv = ["generate", str(TINY / "tiny-qwen3.gguf"),
            "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-new-tokens", "12", "--temperature",
            "0.5", "--seed", "3", "--ignore-eos", "--backend", "cpu", "--step-profile"]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0
    result = json.loads(out)
    t, u = result["timings"], result["usage"]
    assert t["verify_ms"] > 0 and t["heads_ms"] > 0 and t["other_ms"] > 0
    assert u["decode_steps"] + u["accepted_draft_tokens"] == 11
    assert err.count("step_profile") == u["decode_steps"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0 and re.search(r"steps: draft [\d.]+ ms, heads [\d.]+ ms, verify", err)
