"""ModelSpec: everything the transformer needs to know about an architecture, as data.

One `ArchTraits` entry per supported architecture says how it differs from plain llama (q/k
norms, post-norms, activation, embedding scale, sliding-window pattern, RoPE variant, MoE
routing); `ModelSpec.from_gguf` reads the hyperparameters and checks every tensor's shape so
that a file that passes it can be loaded without surprises.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile


class RopeMode(enum.Enum):
    NORMAL = "normal"   # rotate adjacent pairs (x[2i], x[2i+1]): llama's permuted q/k weights
    NEOX = "neox"       # rotate halves (x[i], x[i + d/2])


class Activation(enum.Enum):
    SILU = "silu"             # SwiGLU: silu(gate) * up
    GELU_TANH = "gelu_tanh"   # GeGLU with the tanh approximation of GELU


@dataclass(frozen=True)
class ArchTraits:
    rope_mode: RopeMode = RopeMode.NORMAL
    activation: Activation = Activation.SILU
    qk_norm: bool = False            # per-head RMSNorm on q and k before RoPE
    qkv_bias: bool = False
    post_norms: bool = False         # RMSNorm on the attention and FFN outputs before the residual
    embed_scale_sqrt: bool = False   # multiply embeddings by sqrt(n_embd)
    moe: bool = False
    # layer -> sliding window size (0 = full attention); given the file's window and n_layer
    window_pattern: Callable[[int, int], int] | None = None
    swa_rope_base: float | None = None   # RoPE base on sliding-window layers, when it differs


def _gemma3_window(layer: int, window: int) -> int:
    # Five local (sliding-window) layers, then one global layer, repeating.
    return 0 if layer % 6 == 5 else window


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(),
    "qwen2": ArchTraits(rope_mode=RopeMode.NEOX, qkv_bias=True),
    "qwen3": ArchTraits(rope_mode=RopeMode.NEOX, qk_norm=True),
    "qwen3moe": ArchTraits(rope_mode=RopeMode.NEOX, qk_norm=True, moe=True),
    "gemma3": ArchTraits(rope_mode=RopeMode.NEOX, activation=Activation.GELU_TANH, qk_norm=True,
                         post_norms=True, embed_scale_sqrt=True, window_pattern=_gemma3_window,
                         swa_rope_base=10_000.0),
}


@dataclass(frozen=True)
class MoESpec:
    n_expert: int
    n_expert_used: int
    n_ff_expert: int
    normalize_top_k: bool = True     # renormalize the selected softmax weights to sum to 1


@dataclass(frozen=True)
class LayerSpec:
    window: int          # 0 = full causal attention, else keys with q_pos - k_pos < window
    rope_base: float


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    traits: ArchTraits
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int            # q/k head size
    head_dim_v: int
    n_ff: int
    vocab_size: int
    n_ctx_train: int
    rms_eps: float
    rope_dims: int
    attn_scale: float
    embed_scale: float
    tied_output: bool
    layers: tuple[LayerSpec, ...]
    moe: MoESpec | None = None
    file_type: str = ""
    n_params: int = 0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ModelSpec:
        arch = f.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{f.path}: metadata 'general.architecture' is missing")
        traits = ARCHITECTURES.get(arch)
        if traits is None:
            raise ModelFormatError(
                f"{f.path}: unsupported architecture {arch!r}; supported: "
                + ", ".join(sorted(ARCHITECTURES)))

        def num(key: str, default: float | None = None, lo: float = 1, hi: float = 1 << 24):
            full = f"{arch}.{key}"
            if full not in f.metadata and default is not None:
                return default
            value = f.require(full)
            if isinstance(value, list) or not lo <= value <= hi:
                raise ModelFormatError(f"{f.path}: metadata {full!r} = {value!r} is out of "
                                       f"range [{lo}, {hi}]")
            return value

        n_embd = int(num("embedding_length"))
        n_head = int(num("attention.head_count", hi=4096))
        n_head_kv = int(num("attention.head_count_kv", n_head, hi=4096))
        if n_head % n_head_kv:
            raise ModelFormatError(f"{f.path}: head_count {n_head} is not a multiple of "
                                   f"head_count_kv {n_head_kv}")
        head_dim = int(num("attention.key_length", n_embd // n_head, hi=4096))
        head_dim_v = int(num("attention.value_length", head_dim, hi=4096))
        n_layer = int(num("block_count", hi=1024))
        tokens = f.get("tokenizer.ggml.tokens")
        vocab = int(num("vocab_size", len(tokens) if isinstance(tokens, list) else None))
        rope_dims = int(num("rope.dimension_count", head_dim, hi=4096))
        if rope_dims > head_dim or rope_dims % 2:
            raise ModelFormatError(f"{f.path}: rope.dimension_count {rope_dims} must be even "
                                   f"and <= head size {head_dim}")
        rope_base = float(num("rope.freq_base", 10_000.0, lo=1.0, hi=1e12))
        window = int(num("attention.sliding_window", 0, lo=0, hi=1 << 24))
        layers = []
        for i in range(n_layer):
            w = traits.window_pattern(i, window) if traits.window_pattern and window else 0
            base = traits.swa_rope_base if (w and traits.swa_rope_base) else rope_base
            layers.append(LayerSpec(window=w, rope_base=base))
        moe = None
        n_ff = int(num("feed_forward_length", 0, lo=0))
        if traits.moe:
            moe = MoESpec(n_expert=int(num("expert_count", hi=4096)),
                          n_expert_used=int(num("expert_used_count", hi=4096)),
                          n_ff_expert=int(num("expert_feed_forward_length")))
            if moe.n_expert_used > moe.n_expert:
                raise ModelFormatError(f"{f.path}: expert_used_count > expert_count")
        elif n_ff <= 0:
            raise ModelFormatError(f"{f.path}: metadata '{arch}.feed_forward_length' is missing")
        spec = cls(
            arch=arch, traits=traits, name=str(f.get("general.name", f.path.stem)),
            n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
            head_dim=head_dim, head_dim_v=head_dim_v, n_ff=n_ff, vocab_size=vocab,
            n_ctx_train=int(num("context_length", 2048, hi=1 << 24)),
            rms_eps=float(num("attention.layer_norm_rms_epsilon", 1e-5, lo=0.0, hi=1.0)),
            rope_dims=rope_dims, attn_scale=1.0 / math.sqrt(head_dim),
            embed_scale=math.sqrt(n_embd) if traits.embed_scale_sqrt else 1.0,
            tied_output=not f.has_tensor("output.weight"), layers=tuple(layers), moe=moe,
            file_type=_file_type(f), n_params=sum(t.n_elements for t in f.tensors.values()),
        )
        spec.check_tensors(f)
        return spec

    # ------------------------------------------------------------------ tensor shapes
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the transformer reads, with its row-major shape (out, in)."""
        e, hd, hv = self.n_embd, self.head_dim, self.head_dim_v
        q, kv = self.n_head * hd, self.n_head_kv * hd
        shapes: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.vocab_size, e), "output_norm.weight": (e,)}
        if not self.tied_output:
            shapes["output.weight"] = (self.vocab_size, e)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            shapes |= {p + "attn_norm.weight": (e,), p + "attn_q.weight": (q, e),
                       p + "attn_k.weight": (kv, e), p + "attn_v.weight": (self.n_head_kv * hv, e),
                       p + "attn_output.weight": (e, self.n_head * hv),
                       p + "ffn_norm.weight": (e,)}
            if self.traits.qkv_bias:
                shapes |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                           p + "attn_v.bias": (self.n_head_kv * hv,)}
            if self.traits.qk_norm:
                shapes |= {p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)}
            if self.traits.post_norms:
                shapes |= {p + "post_attention_norm.weight": (e,),
                           p + "post_ffw_norm.weight": (e,)}
            if self.moe:
                m = self.moe
                shapes |= {p + "ffn_gate_inp.weight": (m.n_expert, e),
                           p + "ffn_gate_exps.weight": (m.n_expert, m.n_ff_expert, e),
                           p + "ffn_up_exps.weight": (m.n_expert, m.n_ff_expert, e),
                           p + "ffn_down_exps.weight": (m.n_expert, e, m.n_ff_expert)}
            else:
                shapes |= {p + "ffn_gate.weight": (self.n_ff, e),
                           p + "ffn_up.weight": (self.n_ff, e),
                           p + "ffn_down.weight": (e, self.n_ff)}
        return shapes

    def check_tensors(self, f: GGUFFile) -> None:
        for name, shape in self.tensor_shapes().items():
            f.tensor(name, shape)


def _file_type(f: GGUFFile) -> str:
    """The dominant quant type of the 2-D weights, e.g. 'Q4_1' (a label for humans)."""
    counts: dict[str, int] = {}
    for t in f.tensors.values():
        if len(t.shape) >= 2:
            counts[t.qtype.name] = counts.get(t.qtype.name, 0) + t.n_elements
    return max(counts, key=counts.get) if counts else "F32"
