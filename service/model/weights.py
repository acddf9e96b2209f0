"""Load a GGUF file's tensors into backend weight handles, fusing q|k|v and gate|up rows."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.backends.base import Backend
from service.gguf.quants import dequantize
from service.gguf.reader import GGUFFile, TensorInfo
from service.model.spec import ModelSpec


@dataclass
class LayerWeights:
    attn_norm: Any                   # (E,) f32
    qkv: list[tuple[Any, int, int]]  # [(matrix, first column, last column)] into the q|k|v row
    qkv_bias: Any | None             # (Q + K + V,) f32
    q_norm: Any | None               # (hd,) f32
    k_norm: Any | None
    wo: Any                          # (E, H*Dv)
    post_attn_norm: Any | None
    ffn_norm: Any
    gate_up: list[tuple[Any, int, int]] | None   # into the gate|up row (2F,)
    down: Any | None
    post_ffw_norm: Any | None
    router: Any | None = None        # MoE: (n_expert, E)
    gate_exps: Any | None = None
    up_exps: Any | None = None
    down_exps: Any | None = None
    router_bias: Any | None = None   # (n_expert,) f32 selection bias (exp_probs_b)
    shared_gate_up: list[tuple[Any, int, int]] | None = None   # shared expert: gate|up (2Fs,)
    shared_down: Any | None = None


@dataclass
class Weights:
    embedding: Any
    output_norm: Any
    output: Any                      # (vocab, E)
    layers: list[LayerWeights]
    load_seconds: float = 0.0        # how long load_weights took (reported as a load phase)


def _fused(backend: Backend, tensors: list[TensorInfo]) -> list[tuple[Any, int, int]]:
    """One matrix for all tensors when the backend can fuse them, else one each."""
    if backend.can_fuse(tensors):
        n = sum(t.shape[0] for t in tensors)
        return [(backend.load_matrix(tensors), 0, n)]
    out, col = [], 0
    for t in tensors:
        out.append((backend.load_matrix([t]), col, col + t.shape[0]))
        col += t.shape[0]
    return out


def load_weights(spec: ModelSpec, f: GGUFFile, backend: Backend) -> Weights:
    t0 = time.perf_counter()
    vec = backend.load_vector
    layers = []
    for i, lay in enumerate(spec.layers):
        p = f"blk.{i}."

        def t(name: str, p: str = p) -> TensorInfo:
            return f.tensor(p + name)

        def opt(name: str, on: bool, p: str = p):
            return vec(f.tensor(p + name)) if on else None

        bias = None
        if spec.traits.qkv_bias:
            parts = [dequantize(t(n).raw, t(n).qtype, t(n).shape)
                     for n in ("attn_q.bias", "attn_k.bias", "attn_v.bias")]
            bias = backend.upload_vector(np.concatenate(parts))           # (Q+K+V,) f32
        lw = LayerWeights(
            attn_norm=vec(t("attn_norm.weight")),
            # the attention gate's rows (when there is one) follow q|k|v: one matmul for all
            qkv=_fused(backend, [t("attn_q.weight"), t("attn_k.weight"), t("attn_v.weight")]
                       + ([t("attn_gate.weight")] if lay.attn_gate else [])),
            qkv_bias=bias,
            q_norm=opt("attn_q_norm.weight", spec.traits.qk_norm),
            k_norm=opt("attn_k_norm.weight", spec.traits.qk_norm),
            wo=backend.load_matrix([t("attn_output.weight")]),
            post_attn_norm=opt("post_attention_norm.weight", spec.traits.post_norms),
            ffn_norm=vec(t("ffn_norm.weight")),
            gate_up=None if lay.moe else _fused(backend, [t("ffn_gate.weight"),
                                                          t("ffn_up.weight")]),
            down=None if lay.moe else backend.load_matrix([t("ffn_down.weight")]),
            post_ffw_norm=opt("post_ffw_norm.weight", spec.traits.post_norms),
        )
        if lay.moe:
            lw.router = backend.load_matrix([t("ffn_gate_inp.weight")])
            lw.gate_exps = backend.load_experts(t("ffn_gate_exps.weight"))
            lw.up_exps = backend.load_experts(t("ffn_up_exps.weight"))
            lw.down_exps = backend.load_experts(t("ffn_down_exps.weight"))
            if spec.moe.selection_bias:
                lw.router_bias = vec(t("exp_probs_b.bias"))
            if spec.moe.n_ff_shared:
                lw.shared_gate_up = _fused(backend, [t("ffn_gate_shexp.weight"),
                                                     t("ffn_up_shexp.weight")])
                lw.shared_down = backend.load_matrix([t("ffn_down_shexp.weight")])
        layers.append(lw)
    out_name = "token_embd.weight" if spec.tied_output else "output.weight"
    return Weights(
        embedding=backend.load_embedding(f.tensor("token_embd.weight")),
        output_norm=vec(f.tensor("output_norm.weight")),
        output=backend.load_matrix([f.tensor(out_name)]),
        layers=layers,
        load_seconds=time.perf_counter() - t0,
    )

