"""EAGLE-3 drafter files in llama.cpp's GGUF format (architecture `eagle3`): what they hold, and
the checks that refuse a bad file (or a file for another target) with the reason.

Facts from llama.cpp (src/models/eagle3.cpp, src/llama-arch.cpp, common/speculative.cpp). The
drafter reads the target's residual stream at three points, `eagle3.target_layers` = [low, mid,
high] in the target-layer convention of service/model/hidden.py (k: the residual entering target
layer k; k = the target's n_layer: its final residual, before the output norm). Per token:

    f = [x_low | x_mid | x_high]                          (3 Et,) f32, Et = target_hidden_size
    f = rms_norm(f) * enc.output_norm      only with eagle3.norm_before_fc
    g = fc @ f                                            (E,)  the "encoder"
    e = rms_norm(embed(token)) * attn_norm                (E,)  token_embd, else the target's
    gn = rms_norm(g) * attn_norm_2                        (E,)
    h = [e | gn] -> q, k, v (each from 2 E inputs), RoPE (normal, not NeoX) on q and k
    r = (gn if eagle3.norm_before_residual else g) + attn_output @ attention(q, k, v)
    y = r + ffn_down @ (silu(ffn_gate @ n) * (ffn_up @ n)),  n = rms_norm(r) * ffn_norm
    logits = output @ (rms_norm(y) * output_norm)        (Vd,) output, else the target's
    d2t: draft row i is target token d2t[i] (absolute ids, I64); other target ids get -inf
y (before the output norm) is the next draft step's g: a chain feeds it back in place of fc's.

Tensors (row-major shapes, the reverse of ggml's ne), one decoder block (block_count = 1):
    fc.weight (E, 3 Et)                 enc.output_norm.weight (3 Et,)  [norm_before_fc]
    blk.0.attn_norm.weight (E,)         blk.0.attn_norm_2.weight (E,)
    blk.0.attn_q.weight (H hd, 2 E)     blk.0.attn_k.weight, blk.0.attn_v.weight (Hkv hd, 2 E)
    blk.0.attn_output.weight (E, H hd)  blk.0.ffn_norm.weight (E,)
    blk.0.ffn_gate.weight, blk.0.ffn_up.weight (F, E)   blk.0.ffn_down.weight (E, F)
    output_norm.weight (E,)             output.weight (Vd, E)     [optional: the target's]
    token_embd.weight (V, E)  [optional: the target's]            d2t (Vd,) I64 [optional]
    rope_freqs.weight (rope_dims / 2,)  [optional]
Metadata: eagle3.{target_layers (3 ints), target_hidden_size, embedding_length, block_count,
feed_forward_length, context_length, attention.head_count, attention.head_count_kv,
attention.layer_norm_rms_epsilon}, optional eagle3.{rope.freq_base, rope.dimension_count,
attention.key_length, norm_before_fc, norm_before_residual, vocab_size}; the target's tokenizer
(V = its token count, or eagle3.vocab_size). Hugging Face EAGLE-3 checkpoints store d2t as
offsets (target = i + d2t[i]); llama.cpp's files hold the absolute ids, which its graph uses as
row indices.
"""

from __future__ import annotations

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

ARCH = "eagle3"
N_POINTS = 3                  # llama.cpp: "EAGLE3 requires exactly 3 entries"


@dataclass(frozen=True)
class Eagle3Spec:
    n_embd: int               # E, the drafter's width
    n_embd_target: int        # Et, target_hidden_size
    target_layers: tuple[int, int, int]
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab_size: int           # V, the target's vocabulary (the tokenizer's token count)
    draft_vocab: int          # Vd: d2t's length, else V
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dims: int
    norm_before_fc: bool
    norm_before_residual: bool
    own_embedding: bool       # token_embd.weight present (else the target's is used)
    own_output: bool          # output.weight present (else the target's is used)
    has_d2t: bool
    has_rope_freqs: bool

    @property
    def tap(self) -> HiddenTap:
        """The target steps' hidden-state tap this drafter reads (every row: its encoder runs
        on each accepted token)."""
        return HiddenTap(self.target_layers, HiddenRows.ALL)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the file holds (optional ones as this spec says) -> row-major shape."""
        E, Et, hd = self.n_embd, self.n_embd_target, self.head_dim
        q, kv, F = self.n_head * hd, self.n_head_kv * hd, self.n_ff
        shapes = {
            "fc.weight": (E, N_POINTS * Et),
            "blk.0.attn_norm.weight": (E,), "blk.0.attn_norm_2.weight": (E,),
            "blk.0.attn_q.weight": (q, 2 * E), "blk.0.attn_k.weight": (kv, 2 * E),
            "blk.0.attn_v.weight": (kv, 2 * E), "blk.0.attn_output.weight": (E, q),
            "blk.0.ffn_norm.weight": (E,), "blk.0.ffn_gate.weight": (F, E),
            "blk.0.ffn_up.weight": (F, E), "blk.0.ffn_down.weight": (E, F),
            "output_norm.weight": (E,)}
        if self.norm_before_fc:
            shapes["enc.output_norm.weight"] = (N_POINTS * Et,)
        if self.own_output:
            shapes["output.weight"] = (self.draft_vocab, E)
        if self.own_embedding:
            shapes["token_embd.weight"] = (self.vocab_size, E)
        if self.has_d2t:
            shapes[D2T] = (self.draft_vocab,)
        if self.has_rope_freqs:
            shapes["rope_freqs.weight"] = (self.rope_dims // 2,)
        return shapes

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Eagle3Spec:
        """The spec of an `eagle3` file; ModelFormatError naming the key or tensor at fault."""
        keys = DrafterKeys(f, ARCH, "EAGLE-3")
        layers = keys.target_layers(N_POINTS, N_POINTS)
        n_block = int(keys.num("block_count", hi=1024))
        if n_block != 1:
            raise ModelFormatError(f"{f.path}: metadata '{ARCH}.block_count' = {n_block}: an "
                                   "EAGLE-3 drafter has exactly one decoder block")
        a = keys.attention()
        V = keys.vocab_size()
        has_d2t = f.has_tensor(D2T)
        spec = cls(
            n_embd=a.n_embd, n_embd_target=int(keys.num("target_hidden_size")),
            target_layers=layers, n_head=a.n_head, n_head_kv=a.n_head_kv,
            head_dim=a.head_dim, n_ff=int(keys.num("feed_forward_length")), vocab_size=V,
            draft_vocab=f.tensor(D2T).shape[0] if has_d2t else V,
            n_ctx_train=int(keys.num("context_length")),
            rms_eps=float(keys.num("attention.layer_norm_rms_epsilon", lo=0.0, hi=1.0)),
            rope_base=float(keys.num("rope.freq_base", 10_000.0, lo=1.0, hi=1e12)),
            rope_dims=a.rope_dims, norm_before_fc=keys.flag("norm_before_fc"),
            norm_before_residual=keys.flag("norm_before_residual"),
            own_embedding=f.has_tensor("token_embd.weight"),
            own_output=f.has_tensor("output.weight"), has_d2t=has_d2t,
            has_rope_freqs=f.has_tensor("rope_freqs.weight"))
        spec._check_tensors(f)
        return spec

    def _check_tensors(self, f: GGUFFile) -> None:
        check_tensor_types(f, self.tensor_shapes(), "EAGLE-3")
        if self.has_d2t:      # a permutation of the full vocabulary may use the target's output
            check_d2t(f, self.vocab_size, self.draft_vocab != self.vocab_size)

    # ---------------------------------------------------------------- the target
    def check_target(self, target: ModelSpec, where: str = "draft model") -> None:
        """Refuse a target this drafter was not made for (ModelFormatError with the reason)."""
        if self.n_embd_target != target.n_embd:
            raise ModelFormatError(f"{where}: target_hidden_size {self.n_embd_target} but the "
                                   f"target's embedding length is {target.n_embd}")
        check_reads_target(self.target_layers, self.vocab_size, target, where)
        shared = [w for w, own in (("token_embd", self.own_embedding),
                                   ("output", self.own_output)) if not own]
        if shared and target.n_embd != self.n_embd:
            raise ModelFormatError(f"{where}: uses the target's {' and '.join(shared)} (width "
                                   f"{target.n_embd}) but its own width is {self.n_embd}")
