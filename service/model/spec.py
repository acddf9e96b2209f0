"""ModelSpec: everything the transformer needs to know about an architecture, as data.

One `ArchTraits` entry per supported architecture says how it differs from plain llama (q/k
norms, post-norms, activation, embedding scale, sliding-window pattern, RoPE variant, MoE
routing, attention output gate, shared expert, leading dense layers); `ModelSpec.from_gguf`
reads the hyperparameters and checks every tensor's shape so that a file that passes it can be
loaded without surprises. What varies by layer (query head count, window, RoPE base, dimension
count and scaling, dense or MoE FFN, gate width) is in `LayerSpec`, one per layer.
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


class Router(enum.Enum):
    SOFTMAX = "softmax"       # MoE expert probabilities: softmax of the router logits
    SIGMOID = "sigmoid"       # the logistic function of each logit


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
    # Laguna (llama.cpp src/models/laguna.cpp):
    swa_rope_keys: bool = False      # SWA layers read rope.freq_base_swa / dimension_count_swa
    swa_pattern_key: bool = False    # attention.sliding_window_pattern (period, full first, or
    #                                  one bool per layer) overrides window_pattern
    rope_scaling: bool = False       # rope.scaling.* (YaRN) on full-attention layers only
    attn_gate: bool = False          # x softplus(h @ Wg^T) on the attention output, per head
    #                                  or per element (by the attn_gate tensor's width)
    per_layer_heads: bool = False    # attention.head_count may be an array (one per layer)
    router: Router = Router.SOFTMAX  # MoE router (a file's expert_gating_func overrides it)
    expert_bias: bool = False        # exp_probs_b: added to the router probs for selection only
    shared_expert: bool = False      # an always-on expert (ffn_*_shexp) added to the MoE output
    dense_lead: bool = False         # leading_dense_block_count layers with a dense FFN
    norm_top_k_default: bool = True  # renormalize the selected weights (unless the file says)
    routing_keys: bool = False       # read expert_gating_func / _weights_norm / _weights_scale
    #                                  (qwen3moe's llama.cpp graph fixes softmax, norm, no scale)


def _gemma3_window(layer: int, window: int) -> int:
    # Five local (sliding-window) layers, then one global layer, repeating.
    return 0 if layer % 6 == 5 else window


def _laguna_window(layer: int, window: int) -> int:
    # One full-attention layer, then three sliding-window layers, repeating (full first).
    return 0 if layer % 4 == 0 else window


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(),
    "qwen2": ArchTraits(rope_mode=RopeMode.NEOX, qkv_bias=True),
    "qwen3": ArchTraits(rope_mode=RopeMode.NEOX, qk_norm=True),
    "qwen3moe": ArchTraits(rope_mode=RopeMode.NEOX, qk_norm=True, moe=True),
    "gemma3": ArchTraits(rope_mode=RopeMode.NEOX, activation=Activation.GELU_TANH, qk_norm=True,
                         post_norms=True, embed_scale_sqrt=True, window_pattern=_gemma3_window,
                         swa_rope_base=10_000.0),
    "laguna": ArchTraits(rope_mode=RopeMode.NEOX, qk_norm=True, moe=True,
                         window_pattern=_laguna_window, swa_rope_keys=True, swa_pattern_key=True,
                         rope_scaling=True,
                         attn_gate=True, per_layer_heads=True, router=Router.SIGMOID,
                         expert_bias=True, shared_expert=True, dense_lead=True,
                         norm_top_k_default=False, routing_keys=True),
}

# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_* (expert_gating_func) that are supported
GATING_FUNCS = {1: Router.SOFTMAX, 2: Router.SIGMOID}


@dataclass(frozen=True)
class MoESpec:
    n_expert: int
    n_expert_used: int
    n_ff_expert: int
    normalize_top_k: bool = True     # renormalize the selected weights to sum to 1
    router: Router = Router.SOFTMAX  # probs = softmax(logits) or sigmoid(logits)
    selection_bias: bool = False     # top-k on probs + exp_probs_b; weights from probs
    weights_scale: float = 1.0       # selected weights x this (after normalizing)
    n_ff_shared: int = 0             # the shared expert's FFN width (0: none)


@dataclass(frozen=True)
class RopeScaling:
    """YaRN as llama.cpp applies it (ggml rope_yarn): a dimension pair's angle is mixed between
    pos * theta * freq_scale (interpolated) and pos * theta (extrapolated) by a ramp over the
    pairs between the correction dims of beta_fast and beta_slow, and cos/sin are multiplied by
    mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale))."""
    freq_scale: float                # 1 / rope.scaling.factor
    n_ctx_orig: int                  # rope.scaling.original_context_length
    ext_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0         # llama_context's yarn_attn_factor x rope.scaling.attn_factor


@dataclass(frozen=True)
class LayerSpec:
    window: int          # 0 = full causal attention, else keys with q_pos - k_pos < window
    rope_base: float
    n_head: int = 0      # query heads of this layer (ModelSpec.from_gguf fills every field)
    rope_dims: int = 0   # dimensions rotated, from the first of each head
    rope_scaling: RopeScaling | None = None
    moe: bool = False    # a mixture-of-experts FFN (else dense, n_ff wide)
    attn_gate: int = 0   # softplus gate values per head: 0 none, 1 per head, head_dim per element


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    traits: ArchTraits
    name: str
    n_layer: int
    n_embd: int
    n_head: int              # the most query heads of any layer (LayerSpec.n_head per layer)
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
        n_layer = int(num("block_count", hi=1024))
        heads = f.get(f"{arch}.attention.head_count")
        if isinstance(heads, list) and traits.per_layer_heads:
            if len(heads) != n_layer or not all(isinstance(h, int) and 1 <= h <= 4096
                                                for h in heads):
                raise ModelFormatError(f"{f.path}: metadata '{arch}.attention.head_count' "
                                       f"must be {n_layer} head counts in [1, 4096]")
            layer_heads = [int(h) for h in heads]
        else:
            layer_heads = [int(num("attention.head_count", hi=4096))] * n_layer
        n_head = max(layer_heads)
        n_head_kv = int(num("attention.head_count_kv", n_head, hi=4096))
        for h in layer_heads:
            if h % n_head_kv:
                raise ModelFormatError(f"{f.path}: head_count {h} is not a multiple of "
                                       f"head_count_kv {n_head_kv}")
        head_dim = int(num("attention.key_length", n_embd // n_head, hi=4096))
        head_dim_v = int(num("attention.value_length", head_dim, hi=4096))
        tokens = f.get("tokenizer.ggml.tokens")
        vocab = int(num("vocab_size", len(tokens) if isinstance(tokens, list) else None))

        def dims(key: str, default: int) -> int:
            d = int(num(key, default, hi=4096))
            if d > head_dim or d % 2:
                raise ModelFormatError(f"{f.path}: {key} {d} must be even and <= head size "
                                       f"{head_dim}")
            return d

        rope_dims = dims("rope.dimension_count", head_dim)
        rope_base = float(num("rope.freq_base", 10_000.0, lo=1.0, hi=1e12))
        window = int(num("attention.sliding_window", 0, lo=0, hi=1 << 24))
        n_ctx_train = int(num("context_length", 2048, hi=1 << 24))
        swa_base, swa_dims = traits.swa_rope_base or rope_base, rope_dims
        if traits.swa_rope_keys:
            swa_base = float(num("rope.freq_base_swa", rope_base, lo=1.0, hi=1e12))
            swa_dims = dims("rope.dimension_count_swa", rope_dims)
        scaling = _rope_scaling(f, arch, n_ctx_train) if traits.rope_scaling else None
        n_dense = int(num("leading_dense_block_count", 0, lo=0, hi=n_layer)) \
            if traits.dense_lead else 0
        pattern = traits.window_pattern
        if traits.swa_pattern_key and window:
            pattern = _swa_pattern(f, arch, n_layer) or pattern
        layers = []
        for i in range(n_layer):
            w = pattern(i, window) if pattern and window else 0
            gate = 0
            if traits.attn_gate:
                g = f.tensor(f"blk.{i}.attn_gate.weight")
                gate = g.shape[0] // layer_heads[i] if g.shape[0] in (
                    layer_heads[i], layer_heads[i] * head_dim_v) else -1
                if gate < 0:
                    raise ModelFormatError(
                        f"{f.path}: blk.{i}.attn_gate.weight has {g.shape[0]} rows; "
                        f"{layer_heads[i]} (per head) or {layer_heads[i] * head_dim_v} "
                        "(per element) expected")
            layers.append(LayerSpec(window=w, rope_base=swa_base if w else rope_base,
                                    n_head=layer_heads[i], rope_dims=swa_dims if w else rope_dims,
                                    rope_scaling=None if w else scaling,
                                    moe=traits.moe and i >= n_dense, attn_gate=gate))
        moe = None
        n_ff = int(num("feed_forward_length", 0, lo=0))
        if traits.moe:
            keys = traits.routing_keys
            gating = int(num("expert_gating_func", 0, lo=0, hi=16)) if keys else 0
            router = GATING_FUNCS.get(gating, traits.router) if gating else traits.router
            if gating and gating not in GATING_FUNCS:
                raise ModelFormatError(f"{f.path}: {arch}.expert_gating_func {gating} is not "
                                       "supported (1 softmax, 2 sigmoid)")
            norm = f.get(f"{arch}.expert_weights_norm", traits.norm_top_k_default) if keys \
                else traits.norm_top_k_default
            moe = MoESpec(n_expert=int(num("expert_count", hi=4096)),
                          n_expert_used=int(num("expert_used_count", hi=4096)),
                          n_ff_expert=int(num("expert_feed_forward_length")),
                          normalize_top_k=bool(norm), router=router,
                          selection_bias=traits.expert_bias,
                          weights_scale=float(num("expert_weights_scale", 1.0, lo=0.0,
                                                  hi=1e6)) or 1.0 if keys else 1.0,
                          n_ff_shared=int(num("expert_shared_feed_forward_length",
                                              int(num("expert_feed_forward_length"))))
                          if traits.shared_expert else 0)
            if moe.n_expert_used > moe.n_expert:
                raise ModelFormatError(f"{f.path}: expert_used_count > expert_count")
        if (not traits.moe or n_dense) and n_ff <= 0:
            raise ModelFormatError(f"{f.path}: metadata '{arch}.feed_forward_length' is missing")
        spec = cls(
            arch=arch, traits=traits, name=str(f.get("general.name", f.path.stem)),
            n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
            head_dim=head_dim, head_dim_v=head_dim_v, n_ff=n_ff, vocab_size=vocab,
            n_ctx_train=n_ctx_train,
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
        for i, lay in enumerate(self.layers):
            p = f"blk.{i}."
            q = lay.n_head * hd
            shapes |= {p + "attn_norm.weight": (e,), p + "attn_q.weight": (q, e),
                       p + "attn_k.weight": (kv, e), p + "attn_v.weight": (self.n_head_kv * hv, e),
                       p + "attn_output.weight": (e, lay.n_head * hv),
                       p + "ffn_norm.weight": (e,)}
            if self.traits.qkv_bias:
                shapes |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                           p + "attn_v.bias": (self.n_head_kv * hv,)}
            if self.traits.qk_norm:
                shapes |= {p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)}
            if lay.attn_gate:
                shapes[p + "attn_gate.weight"] = (lay.n_head * lay.attn_gate, e)
            if self.traits.post_norms:
                shapes |= {p + "post_attention_norm.weight": (e,),
                           p + "post_ffw_norm.weight": (e,)}
            if lay.moe:
                m = self.moe
                shapes |= {p + "ffn_gate_inp.weight": (m.n_expert, e),
                           p + "ffn_gate_exps.weight": (m.n_expert, m.n_ff_expert, e),
                           p + "ffn_up_exps.weight": (m.n_expert, m.n_ff_expert, e),
                           p + "ffn_down_exps.weight": (m.n_expert, e, m.n_ff_expert)}
                if m.selection_bias:
                    shapes[p + "exp_probs_b.bias"] = (m.n_expert,)
                if m.n_ff_shared:
                    shapes |= {p + "ffn_gate_shexp.weight": (m.n_ff_shared, e),
                               p + "ffn_up_shexp.weight": (m.n_ff_shared, e),
                               p + "ffn_down_shexp.weight": (e, m.n_ff_shared)}
            else:
                shapes |= {p + "ffn_gate.weight": (self.n_ff, e),
                           p + "ffn_up.weight": (self.n_ff, e),
                           p + "ffn_down.weight": (e, self.n_ff)}
        return shapes

    def check_tensors(self, f: GGUFFile) -> None:
        for name, shape in self.tensor_shapes().items():
            if f.tensor(name, shape).qtype.name in ("I32", "I64"):    # an index table type
                raise ModelFormatError(f"{f.path}: tensor {name!r} has integer type "
                                       f"{f.tensor(name).qtype.name}; a weight is float or "
                                       "quantized")


def _swa_pattern(f: GGUFFile, arch: str, n_layer: int) -> Callable[[int, int], int] | None:
    """attention.sliding_window_pattern as llama.cpp's load_swa_pattern reads it (dense first):
    one bool per layer (true: sliding window), or a period n (layer i slides unless i % n == 0;
    0: every layer); None when absent."""
    key = f"{arch}.attention.sliding_window_pattern"
    value = f.get(key)
    if value is None:
        return None
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ModelFormatError(f"{f.path}: {key} has {len(value)} entries for {n_layer} "
                                   "layers")
        flags = [bool(v) for v in value]
        return lambda layer, window: window if flags[layer] else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelFormatError(f"{f.path}: {key} = {value!r}: a period >= 0 or per-layer flags")
    return lambda layer, window: window if value == 0 or layer % value else 0


def _rope_scaling(f: GGUFFile, arch: str, n_ctx_train: int) -> RopeScaling | None:
    """rope.scaling.* as llama.cpp reads them (llama-model.cpp load_hparams, llama-context.cpp):
    'yarn' with a factor gives YaRN (ext_factor 1, beta_fast 32, beta_slow 1: Laguna reads no
    yarn_* keys); 'linear' a plain position scale; none or factor 1: no scaling."""
    kind = f.get(f"{arch}.rope.scaling.type", "linear")
    factor = float(f.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
    if kind not in ("none", "linear", "yarn"):
        raise ModelFormatError(f"{f.path}: {arch}.rope.scaling.type {kind!r} is not supported "
                               "(none, linear, yarn)")
    if kind == "none" or factor in (0.0, 1.0):
        return None
    if factor < 0:
        raise ModelFormatError(f"{f.path}: {arch}.rope.scaling.factor {factor} is negative")
    attn = float(f.get(f"{arch}.rope.scaling.attn_factor", 1.0))
    if kind == "linear":
        return RopeScaling(freq_scale=1.0 / factor, n_ctx_orig=n_ctx_train, ext_factor=0.0,
                           attn_factor=attn)
    # llama_context: yarn_attn_factor = mscale(factor) / (1 + 0.1 ln factor), which cancels
    # the 1 + 0.1 ln(1 / freq_scale) that rope_yarn multiplies in again
    mscale = 0.1 * math.log(factor) + 1.0
    return RopeScaling(
        freq_scale=1.0 / factor,
        n_ctx_orig=int(f.get(f"{arch}.rope.scaling.original_context_length", n_ctx_train)),
        attn_factor=mscale / (1.0 + 0.1 * math.log(factor)) * attn)


def _file_type(f: GGUFFile) -> str:
    """The dominant quant type of the 2-D weights, e.g. 'Q4_1' (a label for humans)."""
    counts: dict[str, int] = {}
    for t in f.tensors.values():
        if len(t.shape) >= 2:
            counts[t.qtype.name] = counts.get(t.qtype.name, 0) + t.n_elements
    return max(counts, key=counts.get) if counts else "F32"
