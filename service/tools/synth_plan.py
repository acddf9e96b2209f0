"""What a synthetic GGUF file holds: architecture presets, llama.cpp's per-tensor quant mixes,
the tensor plan and the metadata (service/tools/synth.py makes the bytes and writes the file).

`PRESETS` holds real architectures' hyperparameters and tokenizer shapes; `MIXES` which quant
type each tensor gets, following llama.cpp's per-tensor rules for its file types (`tensor_type`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from service.gguf.quants import QuantType, block_spec
from service.model.vocab import TokenType, byte_level_chars


# ---------------------------------------------------------------- presets
@dataclass(frozen=True)
class Vocab:
    """A synthetic vocabulary: byte tokens, unique multi-char pieces, then special tokens."""

    pre: str                          # tokenizer.ggml.pre
    n_normal: int                     # ids below this are byte tokens and pieces
    specials: tuple[str, ...]         # texts of the first special ids (CONTROL)
    filler: str                       # text of the remaining ids, formatted with the id
    filler_type: TokenType
    bos: int
    eos: int
    add_bos: bool


LLAMA3_VOCAB = Vocab("llama-bpe", 128000, (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
    "<|reserved_special_token_{}|>", TokenType.CONTROL, bos=128000, eos=128009, add_bos=True)
QWEN3_VOCAB = Vocab("qwen2", 151643, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                    "[PAD{}]", TokenType.UNUSED, bos=151643, eos=151645, add_bos=False)
TINY_VOCAB = Vocab("llama-bpe", 1016, LLAMA3_VOCAB.specials[:3], "<|reserved_special_token_{}|>",
                   TokenType.CONTROL, bos=1016, eos=1017, add_bos=True)
TINY512_VOCAB = Vocab("llama-bpe", 504, LLAMA3_VOCAB.specials[:3], "<|reserved_special_token_{}|>",
                      TokenType.CONTROL, bos=504, eos=505, add_bos=True)
# Laguna's tokenizer shape (100,352 ids; ids 2 = BOS/EOS as in the converter's notes)
LAGUNA_VOCAB = Vocab("laguna", 100000, ("<|endoftext|>", "<|pad|>", "<s>"), "<|reserved_{}|>",
                     TokenType.CONTROL, bos=100002, eos=100002, add_bos=False)


@dataclass(frozen=True)
class LagunaShape:
    """What a Laguna file has beyond Preset's fields (llama.cpp src/models/laguna.cpp and
    conversion/laguna.py): Preset.n_head is the full-attention layers' query head count."""

    n_head_swa: int            # query heads of the sliding-window layers
    window: int                # attention.sliding_window (full/SWA/SWA/SWA, full first)
    rope_dims: int             # rope.dimension_count (full layers, YaRN)
    swa_rope_base: float       # rope.freq_base_swa
    swa_rope_dims: int         # rope.dimension_count_swa
    yarn_factor: float         # rope.scaling.factor (type yarn)
    yarn_orig_ctx: int         # rope.scaling.original_context_length
    dense_lead: int            # leading_dense_block_count
    n_ff_shared: int           # expert_shared_feed_forward_length
    weights_scale: float       # expert_weights_scale
    gate_per_element: bool = False   # attn_gate rows: n_head * head_dim (M.1) or n_head (XS.2)

    def heads(self, p: Preset, layer: int) -> int:
        return p.n_head if layer % 4 == 0 else self.n_head_swa


@dataclass(frozen=True)
class Preset:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int                 # dense FFN width (MoE: written as metadata only)
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    rope_base: float
    rms_eps: float
    n_ctx: int
    vocab: Vocab
    tied: bool = False        # no output.weight: the output projection is token_embd
    qk_norm: bool = False
    experts: tuple[int, int, int] | None = None   # (count, used, per-expert FFN width)
    laguna: LagunaShape | None = None


PRESETS: dict[str, Preset] = {
    "llama3-8b": Preset("llama", 32, 4096, 14336, 32, 8, 128, 128256, 500000.0, 1e-5, 8192,
                        LLAMA3_VOCAB),
    "llama3.2-1b": Preset("llama", 16, 2048, 8192, 32, 8, 64, 128256, 500000.0, 1e-5, 131072,
                          LLAMA3_VOCAB, tied=True),
    "qwen3-30b-a3b": Preset("qwen3moe", 48, 2048, 6144, 32, 4, 128, 151936, 1e6, 1e-6, 40960,
                            QWEN3_VOCAB, qk_norm=True, experts=(128, 8, 768)),
    # Small enough for CPU tests. ffn_down rows (384) are no multiple of 256, so K-quant mixes
    # fall back to 32-element types there, as llama.cpp does.
    "tiny": Preset("llama", 2, 256, 384, 4, 2, 64, 1024, 500000.0, 1e-5, 2048, TINY_VOCAB),
    "tiny-moe": Preset("qwen3moe", 2, 256, 512, 4, 2, 64, 1024, 1e6, 1e-6, 2048, TINY_VOCAB,
                       qk_norm=True, experts=(8, 2, 256)),
    # The oracle fixtures' qwen3moe (tests/data/tiny, bench/llamacpp_moe_oracle.py): < 1.3 MB
    "tiny-qwen3moe-s": Preset("qwen3moe", 2, 128, 256, 4, 2, 32, 512, 1e6, 1e-6, 1024,
                              TINY512_VOCAB, qk_norm=True, experts=(16, 4, 32)),
    # Laguna-XS.2's shapes. From llama.cpp's laguna.cpp / conversion: 40 layers, hidden 2048,
    # 8 KV heads of 128, vocabulary 100,352, 48 query heads on full layers and 64 on SWA
    # layers, window 512, YaRN theta 500000 over 64 dims (full) and theta 10000 over 128
    # (SWA), one leading dense layer, 256 experts top-8 + one shared expert, a sigmoid router.
    # Assumed (not in llama.cpp's source): the FFN widths (dense 8192, expert and shared 512),
    # the YaRN factor 32 over 4096 positions, the weights scale 2.5 and the context 131072.
    "laguna-xs2": Preset("laguna", 40, 2048, 8192, 48, 8, 128, 100352, 500000.0, 1e-6, 131072,
                         LAGUNA_VOCAB, qk_norm=True, experts=(256, 8, 512),
                         laguna=LagunaShape(64, 512, 64, 10000.0, 128, 32.0, 4096, 1, 512,
                                            2.5)),
    # Small enough for CPU tests and the llama.cpp oracle: a dense first layer (full), three
    # SWA layers (window 8, so a 24-token prompt reaches past it) and a full MoE layer; partial
    # YaRN rotary (16 of 32 dims) on full layers, plain RoPE over 32 dims on SWA layers.
    "tiny-laguna": Preset("laguna", 5, 128, 128, 4, 2, 32, 512, 500000.0, 1e-6, 1024,
                          TINY512_VOCAB, qk_norm=True, experts=(8, 3, 32),
                          laguna=LagunaShape(6, 8, 16, 10000.0, 32, 4.0, 256, 1, 32, 1.5)),
    "tiny-laguna-elem": Preset("laguna", 5, 128, 128, 4, 2, 32, 512, 500000.0, 1e-6, 1024,
                               TINY512_VOCAB, qk_norm=True, experts=(8, 3, 32),
                               laguna=LagunaShape(6, 8, 16, 10000.0, 32, 4.0, 256, 1, 32, 1.5,
                                                  gate_per_element=True)),
}


# ---------------------------------------------------------------- quant mixes
@dataclass(frozen=True)
class Mix:
    base: QuantType
    file_type: int                        # general.file_type (llama.cpp's LLAMA_FTYPE_*)
    more_bits: QuantType | None = None    # attn_v / ffn_down on use_more_bits layers

    @property
    def quantized(self) -> bool:
        return block_spec(self.base).block_size > 1


Q = QuantType
MIXES: dict[str, Mix] = {
    "F32": Mix(Q.F32, 0), "F16": Mix(Q.F16, 1), "BF16": Mix(Q.BF16, 32),
    "Q4_0": Mix(Q.Q4_0, 2), "Q4_1": Mix(Q.Q4_1, 3), "Q8_0": Mix(Q.Q8_0, 7),
    "Q5_0": Mix(Q.Q5_0, 8), "Q5_1": Mix(Q.Q5_1, 9),
    "Q4_K_M": Mix(Q.Q4_K, 15, Q.Q6_K), "Q5_K_M": Mix(Q.Q5_K, 17, Q.Q6_K), "Q6_K": Mix(Q.Q6_K, 18),
    # the low-bit types MoE files ship in; llama.cpp's attn_v / ffn_down bumps for these are
    # finer-grained (by layer index and GQA ratio), here one more_bits type as for Q4_K_M
    "Q2_K": Mix(Q.Q2_K, 10, Q.Q3_K), "Q3_K_M": Mix(Q.Q3_K, 12, Q.Q4_K),
    "IQ4_NL": Mix(Q.IQ4_NL, 25), "IQ4_XS": Mix(Q.IQ4_XS, 30),
}
# llama.cpp's replacement when a row length is no multiple of a K-quant's 256-element block
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.IQ4_NL,
             Q.Q3_K: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL}


def use_more_bits(layer: int, n_layer: int) -> bool:
    """The first and last eighth of the layers, and every third layer in between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_type(mix: Mix, name: str, shape: tuple[int, ...], n_layer: int, tied: bool
                ) -> QuantType:
    """The type llama.cpp's quantizer gives tensor `name` of row-major `shape` for `mix`."""
    if len(shape) < 2 or name.endswith("ffn_gate_inp.weight"):
        return Q.F32                    # norms and the MoE router stay f32
    qtype = mix.base
    if mix.quantized:
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            qtype = qtype if qtype is Q.Q8_0 else Q.Q6_K
        elif mix.more_bits and (".attn_v." in name or ".ffn_down" in name):
            if use_more_bits(int(name.split(".")[1]), n_layer):
                qtype = mix.more_bits
    if shape[-1] % block_spec(qtype).block_size:
        qtype = _FALLBACK.get(qtype, Q.F16)
        if shape[-1] % block_spec(qtype).block_size:
            qtype = Q.F16
    return qtype


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]    # row-major, outermost first
    qtype: QuantType
    norm: bool                # filled with ~1.0 instead of weights

    @property
    def n_bytes(self) -> int:
        spec = block_spec(self.qtype)
        return int(np.prod(self.shape)) // spec.block_size * spec.type_size


def plan_tensors(p: Preset, mix: Mix, n_layer: int) -> list[TensorPlan]:
    e, hd, lg = p.n_embd, p.head_dim, p.laguna
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (p.n_vocab, e))]
    for i in range(n_layer):
        b = f"blk.{i}."
        h = lg.heads(p, i) if lg else p.n_head
        shapes += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (h * hd, e)),
                   (b + "attn_k.weight", (p.n_head_kv * hd, e)),
                   (b + "attn_v.weight", (p.n_head_kv * hd, e)),
                   (b + "attn_output.weight", (e, h * hd))]
        if p.qk_norm:
            shapes += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        if lg:
            shapes.append((b + "attn_gate.weight", (h * (hd if lg.gate_per_element else 1), e)))
        shapes.append((b + "ffn_norm.weight", (e,)))
        if p.experts and not (lg and i < lg.dense_lead):
            n_exp, _, ff = p.experts
            shapes += [(b + "ffn_gate_inp.weight", (n_exp, e)),
                       (b + "ffn_gate_exps.weight", (n_exp, ff, e)),
                       (b + "ffn_up_exps.weight", (n_exp, ff, e)),
                       (b + "ffn_down_exps.weight", (n_exp, e, ff))]
            if lg:
                fs = lg.n_ff_shared
                shapes += [(b + "exp_probs_b.bias", (n_exp,)),
                           (b + "ffn_gate_shexp.weight", (fs, e)),
                           (b + "ffn_up_shexp.weight", (fs, e)),
                           (b + "ffn_down_shexp.weight", (e, fs))]
        else:
            shapes += [(b + "ffn_gate.weight", (p.n_ff, e)), (b + "ffn_up.weight", (p.n_ff, e)),
                       (b + "ffn_down.weight", (e, p.n_ff))]
    shapes.append(("output_norm.weight", (e,)))
    if not p.tied:
        shapes.append(("output.weight", (p.n_vocab, e)))
    return [TensorPlan(n, s, tensor_type(mix, n, s, n_layer, p.tied), n.endswith("norm.weight"))
            for n, s in shapes]


# ---------------------------------------------------------------- vocabulary metadata
def vocab_metadata(v: Vocab, n_vocab: int) -> dict:
    """tokenizer.ggml.* of a byte-level BPE vocabulary: the 256 byte tokens, then unique
    2- and 3-char pieces, then specials. Only the 2-char pieces get merges (one each): the
    `gguf` reader parses every string of the header one by one, so 128k merges would add as
    much load time as the tokens themselves; 3-char pieces are reached only where a
    pre-tokenizer piece equals one (llama-bpe emits such pieces whole)."""
    alphabet = byte_level_chars()
    chars = ([alphabet[0x20]] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
             + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + list("0123456789_"))
    pieces = ("".join(p) for n in (2, 3) for p in itertools.product(chars, repeat=n))
    n_pieces = v.n_normal - 256
    if n_pieces > 64 ** 2 + 64 ** 3 or n_vocab <= v.n_normal + len(v.specials):
        raise ValueError(f"vocabulary of {n_vocab} does not fit {v.n_normal} normal tokens")
    tokens = alphabet + list(itertools.islice(pieces, n_pieces))
    merges = [f"{p[0]} {p[1]}" for p in tokens[256:] if len(p) == 2]
    tokens += v.specials
    tokens += [v.filler.format(i) for i in range(len(tokens), n_vocab)]
    n_special = len(v.specials)
    types = ([int(TokenType.NORMAL)] * v.n_normal + [int(TokenType.CONTROL)] * n_special
             + [int(v.filler_type)] * (n_vocab - v.n_normal - n_special))
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": v.pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": v.bos,
            "tokenizer.ggml.eos_token_id": v.eos, "tokenizer.ggml.add_bos_token": v.add_bos}


# ---------------------------------------------------------------- file metadata
def model_metadata(name: str, p: Preset, mix: Mix, n_layer: int) -> dict:
    """Architecture keys (prefixed with the architecture) plus general.* keys."""
    kv: dict = {"context_length": p.n_ctx, "embedding_length": p.n_embd, "block_count": n_layer,
                "feed_forward_length": p.n_ff, "attention.head_count": p.n_head,
                "attention.head_count_kv": p.n_head_kv, "attention.key_length": p.head_dim,
                "attention.value_length": p.head_dim, "rope.dimension_count": p.head_dim,
                "rope.freq_base": p.rope_base, "attention.layer_norm_rms_epsilon": p.rms_eps,
                "vocab_size": p.n_vocab}
    if p.experts:
        kv |= {"expert_count": p.experts[0], "expert_used_count": p.experts[1],
               "expert_feed_forward_length": p.experts[2]}
    lg = p.laguna
    if lg:   # the keys conversion/laguna.py writes
        kv |= {"attention.head_count": [lg.heads(p, i) for i in range(n_layer)],
               "attention.sliding_window": lg.window, "rope.dimension_count": lg.rope_dims,
               "rope.freq_base_swa": lg.swa_rope_base,
               "rope.dimension_count_swa": lg.swa_rope_dims, "rope.scaling.type": "yarn",
               "rope.scaling.factor": lg.yarn_factor,
               "rope.scaling.original_context_length": lg.yarn_orig_ctx,
               "leading_dense_block_count": lg.dense_lead,
               "expert_shared_feed_forward_length": lg.n_ff_shared,
               "expert_weights_norm": True, "expert_weights_scale": lg.weights_scale,
               "expert_gating_func": 2}
    out = {f"{p.arch}.{k}": v for k, v in kv.items()}
    quant = next(k for k, m in MIXES.items() if m == mix)
    return out | {"general.name": f"synthetic {name} {quant}", "general.file_type": mix.file_type,
                  "general.quantization_version": 2}
