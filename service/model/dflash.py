"""DFlash drafter files in llama.cpp's GGUF format (architecture `dflash`): what they hold, and
the checks that refuse a bad file, an unsupported variant, or a file made for another target.

Facts from llama.cpp (src/models/dflash.cpp, src/llama-arch.cpp, common/speculative.cpp,
conversion/qwen.py). A DFlash drafter is a small Qwen3-style decoder that denoises a block of
B tokens `[last committed token, mask, ..., mask]` in one non-causal forward, attending to the
target's context through K/V rows made from the target's hidden states ("KV injection"):

    f_p = [x_{k0}[p] | x_{k1}[p] | ...]         (P Et,) the target's residuals entering layers
                                                `dflash.target_layers` (service/model/hidden.py
                                                convention; the converter writes HF ids + 1)
    g_p = rms_norm(fc @ f_p) * enc.output_norm   (E,)  one row per committed position p
    K_l[p] = rope(rms_norm(Wk_l g_p) * k_norm_l, p), V_l[p] = Wv_l g_p     for every layer l
    block: x = embed(ids) at positions n .. n + B - 1 (n = the anchor's position); per layer
        q, k, v from rms_norm(x) * attn_norm (q/k norms, NeoX RoPE), attention over the
        context rows [0, n) and the block's own rows, all visible (causal within the block
        only with `dflash.attention.causal` true), then the SiLU FFN; logits = output @
        rms_norm(x) * output_norm; d2t: draft row i is target id d2t[i], others -inf
Row 0 (the anchor) is not read; rows 1 .. B - 1 are the draft. The block's K/V are dropped
after the draft (llama.cpp removes the draft cache's positions >= n); the context rows stay.

Tensors (row-major shapes, the reverse of ggml's ne), L = block_count decoder layers:
    fc.weight (E, P E)               enc.output_norm.weight (E,)     output_norm.weight (E,)
    blk.i.attn_norm.weight (E,)      blk.i.attn_q.weight (H hd, E)   blk.i.attn_output (E, H hd)
    blk.i.attn_k.weight, blk.i.attn_v.weight (Hkv hd, E)            blk.i.attn_{q,k}_norm (hd,)
    blk.i.ffn_norm.weight (E,)       blk.i.ffn_gate/ffn_up.weight (F, E)  ffn_down (E, F)
    token_embd.weight (V, E)  [optional: the target's]   output.weight (Vd, E) [optional: own
    token_embd when present (then Vd = V), else the target's]    d2t (Vd,) I64 [optional]
Metadata: dflash.{target_layers (P ints), embedding_length, block_count, feed_forward_length,
context_length, attention.head_count, attention.layer_norm_rms_epsilon}, optional
dflash.{block_size (16), attention.head_count_kv, attention.key_length, rope.freq_base,
rope.dimension_count, attention.causal, hidden_activation (silu), vocab_size}; the target's
tokenizer with `tokenizer.ggml.mask_token_id`. llama.cpp's encoder input is P x the drafter's
width, so the target's width must equal E.

DSpark (llama.cpp's `draft-dspark`: the same architecture with a Markov head, optional
confidence head) adds, with R the head's rank and h_i = rms_norm(x_i) * output_norm the block
row's final hidden state (the output's input):

    markov_w1.weight (V, R)   markov_w2.weight (Vd, R)   [markov_w2.scale (1,) F32, s; else 1]
    conf_proj.weight (1, E + R)   [conf_proj.bias (1,) F32]
    l_i = base_i + s * W2 @ W1[prev_i]    prev = the anchor for the first draft row, then the
                                          argmax target id of the previous row's l (the chain
                                          is sequential along the block)
    c_i = sigmoid(conf_proj . [h_i ; W1[prev_i]] + bias)   the draft's predicted acceptance
Metadata dflash.sample_from_anchor (bool, default true: the block [anchor, mask x (k - 1)] gives
k drafts from rows 0..k-1, up to block_size; false: DFlash's layout, rows 1..k, row 0
unbiased) and dflash.has_confidence_head (bool; when present it must agree with conf_proj).
common/speculative.cpp stops the drafts at the first row with c_i < p_min (--spec-draft-p-min).

Only the plain block decoder (the public z-lab checkpoints' kind) and DSpark's heads are read;
DFlash2, DeepSeek-V4 DSpark stages and the optional extras in `UNSUPPORTED` are refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.drafter_format import (
    D2T,
    DrafterKeys,
    check_d2t,
    check_reads_target,
    check_tensor_types,
)
from service.model.hidden import HiddenRows, HiddenTap
from service.model.spec import ModelSpec

ARCH = "dflash"
MASK_KEY = "tokenizer.ggml.mask_token_id"
MARKOV_W1, MARKOV_W2, MARKOV_SCALE = "markov_w1.weight", "markov_w2.weight", "markov_w2.scale"
CONF_W, CONF_B = "conf_proj.weight", "conf_proj.bias"
F32_ONLY = (MARKOV_SCALE, CONF_B)   # scalars llama.cpp multiplies / adds as F32
DEFAULT_BLOCK = 16            # common/speculative.cpp, when dflash.block_size is absent
MAX_POINTS = 64


@dataclass(frozen=True)
class Unsupported:
    """A variant this reader refuses: metadata keys (`dflash.` + key) or tensor-name patterns
    that mark it."""

    what: str
    keys: tuple[str, ...] = ()
    tensors: str = ""         # a regular expression matched against whole tensor names


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("DFlash2 (block convolutions and a candidate selector)",
                ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
                r"selector_.*|blk\.\d+\.(attn|ffn)_conv_.*"),
    Unsupported("DeepSeek-V4 DSpark stages (hyper-connections, MLA, MoE)",
                ("hyper_connection.count",),
                r".*hc_.*|blk\.\d+\.(attn_q_[ab]|attn_kv|attn_out_[ab]|ffn_gate_inp|ffn_\w+_exps)"
                r"[._].*"),
    Unsupported("sliding-window attention",
                ("attention.sliding_window", "attention.sliding_window_pattern")),
    Unsupported("M-RoPE sections", ("rope.dimension_sections",)),
    Unsupported("a token-embedding scale", ("embedding_scale",)),
    Unsupported("a custom attention scale", ("attention.scale",)),
    Unsupported("an attention-output scale", ("attention.value_scale",)),
    Unsupported("logit scaling or soft-capping", ("logit_scale", "final_logit_softcapping")),
    Unsupported("attention sinks", (), r"blk\.\d+\.attn_sinks\..*"),
    Unsupported("post-attention / post-FFN norms and layer output scales", (),
                r"blk\.\d+\.(post_attention_norm|post_ffw_norm|layer_output_scale).*"),
    Unsupported("RoPE frequency factors", (), r"rope_freqs\..*"),
    Unsupported("per-tensor weight scales", (), r"(?!markov_w2\.scale$).*\.scale"),
)


def refuse_variants(f: GGUFFile) -> None:
    """ModelFormatError naming the first key or tensor of a variant in UNSUPPORTED."""
    for u in UNSUPPORTED:
        for key in u.keys:
            if f"{ARCH}.{key}" in f.metadata:
                raise ModelFormatError(f"{f.path}: metadata '{ARCH}.{key}' marks {u.what}, "
                                       "which is not supported (only the plain DFlash block "
                                       "decoder and DSpark's heads are)")
        if u.tensors:
            pat = re.compile(u.tensors)
            hit = sorted(n for n in f.tensors if pat.fullmatch(n))
            if hit:
                raise ModelFormatError(f"{f.path}: tensor {hit[0]!r} marks {u.what}, which is "
                                       "not supported (only the plain DFlash block decoder "
                                       "and DSpark's heads are)")
    scaling = f.get(f"{ARCH}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelFormatError(f"{f.path}: metadata '{ARCH}.rope.scaling.type' = {scaling!r}: "
                               "RoPE scaling is not supported")
    act = f.get(f"{ARCH}.hidden_activation", "silu")
    if act != "silu":
        raise ModelFormatError(f"{f.path}: metadata '{ARCH}.hidden_activation' = {act!r}: "
                               "only silu is supported")


@dataclass(frozen=True)
class DflashSpec:
    n_embd: int               # E, the drafter's width (= the target's)
    target_layers: tuple[int, ...]
    n_layer: int              # L, decoder layers
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab_size: int           # V, the target's vocabulary
    draft_vocab: int          # Vd: d2t's length, else V
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dims: int            # NeoX RoPE over the first rope_dims dims of each head
    block_size: int           # B, the trained block: anchor + B - 1 masks
    mask_token: int
    causal: bool              # causal attention within the block (dflash.attention.causal)
    own_embedding: bool       # token_embd.weight present (else the target's)
    own_output: bool          # output.weight present
    has_d2t: bool
    markov_rank: int = 0          # R of DSpark's Markov head (markov_w1/w2); 0: plain DFlash
    markov_scale: bool = False    # markov_w2.scale present
    confidence: bool = False      # DSpark's confidence head (conf_proj.weight) present
    confidence_bias: bool = False  # conf_proj.bias present
    sample_from_anchor: bool = True  # DSpark: drafts from block row 0 (else rows 1..)

    @property
    def n_points(self) -> int:
        return len(self.target_layers)

    @property
    def dspark(self) -> bool:
        """A DSpark drafter (llama.cpp's draft-dspark): the Markov head is there."""
        return self.markov_rank > 0

    @property
    def first_draft_row(self) -> int:
        """The block row of the first draft: 0 for anchor-first DSpark, else 1 (row 0 is the
        anchor's, not read)."""
        return 0 if self.dspark and self.sample_from_anchor else 1

    @property
    def max_drafts(self) -> int:
        """Drafts of one full trained block (llama.cpp's clamp of n_max)."""
        return self.block_size - self.first_draft_row

    @property
    def tap(self) -> HiddenTap:
        """The target steps' hidden-state tap this drafter reads: every row (each committed
        position's K/V rows are injected)."""
        return HiddenTap(self.target_layers, HiddenRows.ALL)

    @property
    def output_name(self) -> str | None:
        """The drafter's own output projection (llama.cpp: output.weight, else its token_embd),
        None: the target's."""
        if self.own_output:
            return "output.weight"
        return "token_embd.weight" if self.own_embedding else None

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the file holds (optional ones as this spec says) -> row-major shape."""
        E, hd, F = self.n_embd, self.head_dim, self.n_ff
        q, kv = self.n_head * hd, self.n_head_kv * hd
        shapes = {"fc.weight": (E, self.n_points * E), "enc.output_norm.weight": (E,),
                  "output_norm.weight": (E,)}
        for i in range(self.n_layer):
            b = f"blk.{i}."
            shapes |= {
                b + "attn_norm.weight": (E,), b + "attn_q.weight": (q, E),
                b + "attn_k.weight": (kv, E), b + "attn_v.weight": (kv, E),
                b + "attn_output.weight": (E, q), b + "attn_q_norm.weight": (hd,),
                b + "attn_k_norm.weight": (hd,), b + "ffn_norm.weight": (E,),
                b + "ffn_gate.weight": (F, E), b + "ffn_up.weight": (F, E),
                b + "ffn_down.weight": (E, F)}
        if self.own_embedding:
            shapes["token_embd.weight"] = (self.vocab_size, E)
        if self.own_output:
            shapes["output.weight"] = (self.draft_vocab, E)
        if self.has_d2t:
            shapes[D2T] = (self.draft_vocab,)
        R = self.markov_rank
        if R:
            shapes |= {MARKOV_W1: (self.vocab_size, R), MARKOV_W2: (self.draft_vocab, R)}
            if self.markov_scale:
                shapes[MARKOV_SCALE] = (1,)
            if self.confidence:
                shapes[CONF_W] = (1, E + R)
            if self.confidence_bias:
                shapes[CONF_B] = (1,)
        return shapes

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_gguf(cls, f: GGUFFile) -> DflashSpec:
        """The spec of a `dflash` file; ModelFormatError naming the key or tensor at fault."""
        keys = DrafterKeys(f, ARCH, "DFlash")
        refuse_variants(f)
        layers = keys.target_layers(1, MAX_POINTS)
        a = keys.attention()
        V = keys.vocab_size()
        if MASK_KEY not in f.metadata:
            raise ModelFormatError(f"{f.path}: metadata {MASK_KEY!r} is missing (the token "
                                   "that fills the block's masked positions)")
        mask = int(f.require(MASK_KEY, int))
        if not 0 <= mask < V:
            raise ModelFormatError(f"{f.path}: {MASK_KEY} = {mask} is outside the vocabulary "
                                   f"of {V} tokens")
        has_d2t = f.has_tensor(D2T)
        spec = cls(
            n_embd=a.n_embd, target_layers=layers, n_layer=int(keys.num("block_count", hi=1024)),
            n_head=a.n_head, n_head_kv=a.n_head_kv, head_dim=a.head_dim,
            n_ff=int(keys.num("feed_forward_length")),
            vocab_size=V, draft_vocab=f.tensor(D2T).shape[0] if has_d2t else V,
            n_ctx_train=int(keys.num("context_length")),
            rms_eps=float(keys.num("attention.layer_norm_rms_epsilon", lo=0.0, hi=1.0)),
            rope_base=float(keys.num("rope.freq_base", 10_000.0, lo=1.0, hi=1e12)),
            rope_dims=a.rope_dims,
            block_size=int(keys.num("block_size", DEFAULT_BLOCK, lo=2, hi=1024)),
            mask_token=mask, causal=keys.flag("attention.causal"),
            own_embedding=f.has_tensor("token_embd.weight"),
            own_output=f.has_tensor("output.weight"), has_d2t=has_d2t, **_dspark_fields(f))
        spec._check_tensors(f)
        return spec

    def _check_tensors(self, f: GGUFFile) -> None:
        shapes = self.tensor_shapes()
        for i in range(self.n_layer):
            if not f.has_tensor(f"blk.{i}.attn_v.weight"):
                raise ModelFormatError(f"{f.path}: tensor 'blk.{i}.attn_v.weight' is missing; "
                                       "shared K/V (a layer without attn_v) is not supported")
        check_tensor_types(f, shapes, "DFlash", F32_ONLY)
        if self.has_d2t:
            check_d2t(f, self.vocab_size, True)

    # ---------------------------------------------------------------- the target
    def check_target(self, target: ModelSpec, where: str = "draft model") -> None:
        """Refuse a target this drafter was not made for (ModelFormatError with the reason)."""
        if target.n_embd != self.n_embd:
            raise ModelFormatError(f"{where}: the drafter's width is {self.n_embd} but the "
                                   f"target's embedding length is {target.n_embd} (llama.cpp's "
                                   "DFlash encoder reads target rows of the drafter's width)")
        check_reads_target(self.target_layers, self.vocab_size, target, where)


def _dspark_fields(f: GGUFFile) -> dict:
    """DflashSpec's DSpark fields of file f (none without markov_w1: a plain DFlash file, whose
    extra tensors _check_tensors refuses)."""
    if not f.has_tensor(MARKOV_W1):
        return {}
    w1 = f.tensor(MARKOV_W1)
    if len(w1.shape) != 2 or not 1 <= w1.shape[1] <= 4096:
        raise ModelFormatError(f"{f.path}: tensor {MARKOV_W1!r} has shape {w1.shape}; (vocab, "
                               "rank) with rank 1..4096 expected")
    if not f.has_tensor(MARKOV_W2):
        raise ModelFormatError(f"{f.path}: DSpark's {MARKOV_W1!r} is present but "
                               f"{MARKOV_W2!r} is missing")
    conf = f.has_tensor(CONF_W)
    key = f"{ARCH}.has_confidence_head"
    if key in f.metadata and bool(f.require(key, bool)) != conf:
        raise ModelFormatError(f"{f.path}: metadata {key!r} = {f.metadata[key]} but tensor "
                               f"{CONF_W!r} is {'present' if conf else 'missing'}")
    if f.has_tensor(CONF_B) and not conf:
        raise ModelFormatError(f"{f.path}: {CONF_B!r} without {CONF_W!r}")
    if f"{ARCH}.block_size" not in f.metadata:     # llama.cpp's DSpark graph asserts it
        raise ModelFormatError(f"{f.path}: a DSpark drafter needs metadata "
                               f"'{ARCH}.block_size'")
    anchor = f"{ARCH}.sample_from_anchor"
    return dict(markov_rank=int(w1.shape[1]), markov_scale=f.has_tensor(MARKOV_SCALE),
                confidence=conf, confidence_bias=f.has_tensor(CONF_B),
                sample_from_anchor=bool(f.require(anchor, bool)) if anchor in f.metadata
                else True)
