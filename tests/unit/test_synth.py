"""Synthetic GGUFs: valid random blocks of every type, llama.cpp's Q4_K_M rule, files that the
loader, the tokenizer and the CPU engine accept, and byte-identical output for a seed."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest

from service.cli import build_parser, main
from service.errors import ConfigError
from service.gguf.quants import QuantType, block_spec, supported_types
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer, byte_level_chars
from service.model.transformer import positions_for
from service.tools import synth
from tests.support.engines import run, running_engine
from tests.support.models import build_model

# byte offsets of the f16 block scale d (and of the second f16: min or dmin) per type
D_AT = {QuantType.Q4_0: 0, QuantType.Q5_0: 0, QuantType.Q8_0: 0, QuantType.Q4_1: 0,
        QuantType.Q5_1: 0, QuantType.Q4_K: 0, QuantType.Q5_K: 0, QuantType.Q6_K: 208,
        QuantType.Q2_K: 80, QuantType.Q3_K: 108, QuantType.IQ4_NL: 0, QuantType.IQ4_XS: 0}
SECOND_AT = {QuantType.Q4_1: 2, QuantType.Q5_1: 2, QuantType.Q4_K: 2, QuantType.Q5_K: 2,
             QuantType.Q2_K: 82}


def tensor_bytes(qtype: QuantType, shape=(64, 1024), name="blk.0.attn_q.weight", norm=False):
    t = synth.TensorPlan(name, shape, qtype, norm)
    spec = block_spec(qtype)
    return synth._chunk_bytes(t, 7, 0, int(np.prod(shape)) // spec.block_size)


def f16_at(raw: np.ndarray, qtype: QuantType, at: int) -> np.ndarray:
    blocks = raw.reshape(-1, block_spec(qtype).type_size)
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)[:, 0]


@pytest.mark.parametrize("qtype", supported_types(), ids=lambda q: q.name)
def test_every_type_dequantizes_finite_with_the_target_spread(qtype):
    raw = tensor_bytes(qtype)
    x = gguf.quants.dequantize(raw.reshape(64, -1), gguf.GGMLQuantizationType(int(qtype)))
    assert x.shape == (64, 1024) and np.isfinite(x).all()
    assert abs(x.std() / synth.WEIGHT_STD - 1) < 0.05, x.std()
    assert abs(x.mean()) < 0.05 * synth.WEIGHT_STD, x.mean()
    if qtype in D_AT:
        d = f16_at(raw, qtype, D_AT[qtype])
        assert np.isfinite(d).all() and (np.abs(d) > 0).all() and np.abs(d).max() < 1e-2
        if synth._FILLS[qtype].signed_d:      # Q4_0 / Q5_0: both signs, as real files have
            assert (d > 0).any() and (d < 0).any()
        else:
            assert (d > 0).all()
        # block scales vary (a kernel reading the wrong block's d would show it)
        assert d.std() > 0.2 * np.abs(d).mean()
    if qtype in SECOND_AT:
        second = f16_at(raw, qtype, SECOND_AT[qtype])
        assert np.isfinite(second).all() and np.abs(second).max() < 1e-1


@pytest.mark.parametrize("qtype,ulp", [(QuantType.F32, 2**-23), (QuantType.F16, 2**-10),
                                       (QuantType.BF16, 2**-7)], ids=["F32", "F16", "BF16"])
def test_norm_weights_are_near_one(qtype, ulp):
    raw = tensor_bytes(qtype, shape=(4096,), name="blk.0.attn_norm.weight", norm=True)
    x = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))
    # uniform in 1 +- NORM_JITTER, rounded to the stored type (one ulp near 1 at most)
    assert np.abs(x - 1).max() <= synth.NORM_JITTER + ulp and abs(x.mean() - 1) < 0.01
    assert np.abs(x - 1).max() > synth.NORM_JITTER / 2


# ---------------------------------------------------------------- quant mixes
def types_by_name(preset: str, quant: str, n_layer: int | None = None) -> dict[str, QuantType]:
    p = synth.PRESETS[preset]
    return {t.name: t.qtype for t in synth.plan_tensors(p, synth.MIXES[quant],
                                                       n_layer or p.n_layer)}


def layers_with(types: dict[str, QuantType], suffix: str, qtype: QuantType) -> set[int]:
    return {int(n.split(".")[1]) for n, q in types.items() if n.endswith(suffix) and q is qtype}


# use_more_bits by hand: first and last n/8 layers, and (i - n/8) % 3 == 2 in between
MORE_BITS_32 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
MORE_BITS_16 = {0, 1, 4, 7, 10, 13, 14, 15}
MORE_BITS_48 = {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41,
                42, 43, 44, 45, 46, 47}


def test_q4_k_m_follows_llamacpp_rule_on_llama3_8b():
    ty = types_by_name("llama3-8b", "Q4_K_M")
    assert layers_with(ty, "attn_v.weight", QuantType.Q6_K) == MORE_BITS_32
    assert layers_with(ty, "ffn_down.weight", QuantType.Q6_K) == MORE_BITS_32
    assert layers_with(ty, "attn_v.weight", QuantType.Q4_K) == set(range(32)) - MORE_BITS_32
    assert ty["output.weight"] is QuantType.Q6_K and ty["token_embd.weight"] is QuantType.Q4_K
    rest = {q for n, q in ty.items() if n.endswith(("attn_q.weight", "attn_k.weight",
                                                    "attn_output.weight", "ffn_gate.weight",
                                                    "ffn_up.weight"))}
    assert rest == {QuantType.Q4_K}
    assert {q for n, q in ty.items() if "norm" in n} == {QuantType.F32}


def test_tied_embeddings_get_the_output_type():
    ty = types_by_name("llama3.2-1b", "Q4_K_M")
    assert "output.weight" not in ty and ty["token_embd.weight"] is QuantType.Q6_K
    assert layers_with(ty, "ffn_down.weight", QuantType.Q6_K) == MORE_BITS_16
    assert types_by_name("llama3.2-1b", "Q8_0")["token_embd.weight"] is QuantType.Q8_0


def test_moe_mix_keeps_the_router_f32_and_bumps_expert_down():
    ty = types_by_name("qwen3-30b-a3b", "Q4_K_M")
    assert {q for n, q in ty.items() if n.endswith("ffn_gate_inp.weight")} == {QuantType.F32}
    assert layers_with(ty, "ffn_down_exps.weight", QuantType.Q6_K) == MORE_BITS_48
    assert layers_with(ty, "attn_v.weight", QuantType.Q6_K) == MORE_BITS_48
    assert {q for n, q in ty.items() if n.endswith("ffn_up_exps.weight")} == {QuantType.Q4_K}


@pytest.mark.parametrize("quant,base,output", [
    ("Q8_0", QuantType.Q8_0, QuantType.Q8_0), ("Q4_0", QuantType.Q4_0, QuantType.Q6_K),
    ("Q6_K", QuantType.Q6_K, QuantType.Q6_K), ("F16", QuantType.F16, QuantType.F16)])
def test_single_type_mixes(quant, base, output):
    ty = types_by_name("llama3-8b", quant, n_layer=4)
    assert ty["output.weight"] is output and ty["token_embd.weight"] is base
    assert {q for n, q in ty.items() if n.startswith("blk.") and "norm" not in n} == {base}


def test_row_length_off_the_k_block_falls_back_like_llamacpp():
    # tiny's ffn_down rows are 384 long: Q4_K -> Q5_0, and Q6_K (more-bits layers) -> Q8_0
    ty = types_by_name("tiny", "Q4_K_M")
    assert ty["blk.1.ffn_down.weight"] is QuantType.Q8_0     # layer 1 of 2 gets more bits
    assert ty["blk.0.ffn_down.weight"] is QuantType.Q5_0
    assert ty["blk.0.ffn_up.weight"] is QuantType.Q4_K


# ---------------------------------------------------------------- vocabulary
def test_vocabulary_is_unique_byte_level_and_round_trips():
    md = synth.vocab_metadata(synth.TINY_VOCAB, 1024)
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == len(set(tokens)) == 1024 and tokens[:256] == byte_level_chars()
    tok = Tokenizer.from_metadata(md)
    assert tok.bos_id == 1016 and tok.token_text(1016) == "<|begin_of_text|>"
    assert tok.eos_id in tok.eog_ids
    text = "Hello wörld 12345 — ok? 🙂\n\tend"
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert any(i >= 256 for i in ids)          # merges make multi-char pieces


# ---------------------------------------------------------------- files
def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_tiny_files_load_and_run_on_cpu(tmp_path, preset):
    r = synth.synthesize(tmp_path / "m.gguf", preset, "Q4_K_M", seed=3)
    f = GGUFFile(r.path)
    spec = ModelSpec.from_gguf(f)
    p = synth.PRESETS[preset]
    assert (spec.arch, spec.n_layer, spec.n_embd, spec.vocab_size) == (
        p.arch, p.n_layer, p.n_embd, p.n_vocab)
    assert spec.file_type == "Q4_K" and (spec.moe is not None) == (p.experts is not None)
    assert r.n_tensors == len(f.tensors) and r.n_bytes == r.path.stat().st_size
    tr = build_model(r.path, n_ctx=32, max_tokens=8)
    ids = np.array([1016, 72, 101, 300, 500, 7], np.int32)
    logits = np.asarray(tr.forward(ids, positions_for(0, 6), np.zeros(6, np.int32), 6, 6))
    assert np.isfinite(logits).all() and 0 < logits.std() < 10


@pytest.mark.parametrize("preset,quant,types", [
    ("tiny-moe", "Q3_K_M", {QuantType.Q3_K, QuantType.Q4_K}),
    ("tiny-moe", "IQ4_XS", {QuantType.IQ4_XS}),
    ("tiny", "IQ4_XS", {QuantType.IQ4_XS, QuantType.IQ4_NL}),
    ("tiny", "Q2_K", {QuantType.Q2_K, QuantType.Q3_K, QuantType.IQ4_NL}),
])
def test_low_bit_mixes_load_and_run_on_cpu(tmp_path, preset, quant, types):
    """The weight types MoE files ship in: a file of each mix loads and runs on the CPU backend,
    its tensors of the types the mix names (row lengths off 256 fall back to IQ4_NL)."""
    r = synth.synthesize(tmp_path / "m.gguf", preset, quant, seed=3)
    f = GGUFFile(r.path)
    assert types <= {t.qtype for t in f.tensors.values()}
    tr = build_model(r.path, n_ctx=32, max_tokens=8)
    ids = np.array([1016, 72, 101, 300, 500, 7], np.int32)
    logits = np.asarray(tr.forward(ids, positions_for(0, 6), np.zeros(6, np.int32), 6, 6))
    assert np.isfinite(logits).all() and 0 < logits.std() < 10


def test_tiny_file_generates_text_through_the_engine(tmp_path):
    path = synth.synthesize(tmp_path / "m.gguf", "tiny", "Q8_0", seed=1).path
    with running_engine(path, n_ctx=64) as eng:
        ids = eng.text_prompt_ids("Hello world")
        assert ids[0] == 1016 and eng.tokenizer.decode(ids[1:]) == "Hello world"
        out = run(eng, ids, max_new_tokens=5, ignore_eos=True, timeout=120).token_ids
    assert len(out) == 5 and all(0 <= t < 1024 for t in out)


def test_same_seed_gives_identical_bytes_whatever_the_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "CHUNK_BYTES", 4096)     # many chunks per tensor
    a = synth.synthesize(tmp_path / "a.gguf", "tiny", "Q4_K_M", seed=11, threads=1).path
    b = synth.synthesize(tmp_path / "b.gguf", "tiny", "Q4_K_M", seed=11, threads=3).path
    c = synth.synthesize(tmp_path / "c.gguf", "tiny", "Q4_K_M", seed=12, threads=3).path
    assert sha256(a) == sha256(b) != sha256(c)


def test_fewer_layers_keep_the_shared_tensors_bytes(tmp_path):
    full = GGUFFile(synth.synthesize(tmp_path / "a.gguf", "tiny", "Q8_0", seed=2).path)
    cut = GGUFFile(synth.synthesize(tmp_path / "b.gguf", "tiny", "Q8_0", seed=2,
                                    n_layer=1).path)
    assert ModelSpec.from_gguf(cut).n_layer == 1 and "blk.1.attn_q.weight" not in cut.tensors
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        np.testing.assert_array_equal(full.tensor(name).raw, cut.tensor(name).raw)


def test_bad_arguments_are_listed_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        synth.synthesize(tmp_path / "x" / "m.gguf", "nope", "Q3_K", n_layer=0, threads=-1)
    assert [p[0] for p in err.value.problems] == ["preset", "quant", "layers", "threads", "out"]


# Published parameter counts: Llama 3 8B 8.03B, Llama 3.2 1B 1.24B, Qwen3-30B-A3B 30.5B.
@pytest.mark.slow
@pytest.mark.parametrize("preset,params", [("llama3-8b", 8.03e9), ("llama3.2-1b", 1.24e9),
                                           ("qwen3-30b-a3b", 30.5e9)])
def test_full_presets_match_the_loader(tmp_path, preset, params):
    r = synth.synthesize(tmp_path / "m.gguf", preset, "Q4_K_M", data=False)
    f = GGUFFile(r.path)
    spec = ModelSpec.from_gguf(f)
    p = synth.PRESETS[preset]
    assert (spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim) == (
        p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim)
    assert (spec.vocab_size, spec.n_ctx_train, spec.tied_output) == (p.n_vocab, p.n_ctx, p.tied)
    assert spec.layers[0].rope_base == p.rope_base and spec.rms_eps == pytest.approx(p.rms_eps)
    if p.experts:
        assert (spec.moe.n_expert, spec.moe.n_expert_used, spec.moe.n_ff_expert) == p.experts
    else:
        assert spec.n_ff == p.n_ff
    assert abs(spec.n_params / params - 1) < 0.01
    tok = Tokenizer.from_metadata(f.metadata)
    assert tok.vocab_size == p.n_vocab and tok.eos_id == p.vocab.eos
    assert tok.decode(tok.encode("The quick brown fox", add_bos=False)) == "The quick brown fox"


# ---------------------------------------------------------------- CLI
def test_cli_writes_the_file_and_reports_it(tmp_path, capsys):
    out = tmp_path / "t.gguf"
    assert main(["synth", "--preset", "tiny", "--quant", "Q4_0", "--seed", "5", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    assert ModelSpec.from_gguf(GGUFFile(out)).file_type == "Q4_0"
    assert main(["synth", "--preset", "llama9", str(tmp_path / "u.gguf")]) == 2
    assert "unknown preset 'llama9'; one of llama3-8b" in capsys.readouterr().err


def test_cli_help_names_every_preset_and_mix():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["synth"]
    helps = {a.dest: a.help for a in sub._actions}
    assert set(helps["preset"].split(" | ")) == set(synth.PRESETS)
    assert set(helps["quant"].split(" (")[0].split(" | ")) == set(synth.MIXES)


@pytest.mark.parametrize("qtype", supported_types(), ids=lambda q: q.name)
def test_random_tensor_is_a_seeded_valid_weight(qtype, monkeypatch):
    """synth.random_tensor (the benchmarks' random weights): whole valid blocks of one tensor,
    chunk after chunk, the same bytes for the same seed."""
    monkeypatch.setattr(synth, "CHUNK_BYTES", 4096)     # many chunks
    shape = (300, 512)
    raw = synth.random_tensor(qtype, shape, seed=5)
    spec = block_spec(qtype)
    assert raw.dtype == np.uint8 and raw.size == 300 * 512 // spec.block_size * spec.type_size
    x = gguf.quants.dequantize(raw.reshape(300, -1), qtype)
    assert np.isfinite(x).all() and abs(x.std() / synth.WEIGHT_STD - 1) < 0.05
    assert np.array_equal(raw, synth.random_tensor(qtype, shape, seed=5))
    assert not np.array_equal(raw, synth.random_tensor(qtype, shape, seed=6))
