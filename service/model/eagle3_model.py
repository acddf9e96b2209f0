"""The EAGLE-3 drafter on a backend: its encoder (fc) and one decoder block over its own KV
cache, written with the backend ops the target's transformer uses (the formulas in eagle3.py;
eagle3_forward.py is the numpy reference it is tested against).

    encode(f, g)                      g (T, E) = fc @ f (rms_norm(f) * enc norm first with
                                      norm_before_fc); f (T, 3 Et) a tapped step's rows
    decode(ids, positions, slots, kv_len, g, n_logits)
        e = rms_norm(embed(ids)) * attn_norm -> h[:, :E];  gn = rms_norm(g) * attn_norm_2 ->
        h[:, E:];  q|k|v = h @ Wqkv;  RoPE (normal) + KV write;  a = attention;
        r = g (or gn) ; r += a @ Wo ; n = rms_norm(r) * ffn_norm ; r += down(silu(gate n) * up n)
        logits = rms_norm(r[last n_logits]) * output_norm @ Wout  (Vd columns)
        r (the workspace `y`) is the pre-norm output a chain feeds back as g.
The logits are over the draft vocabulary (Vd rows of the output): with d2t, draft id i is
target id d2t[i] (`d2t`, a host array); mapping the chosen ids is the drafter's business.
Every buffer is allocated at construction; a step only slices (the transformer's rule). The
head shares the target's backend: its construction sizes the backend's step scratch again over
both models' matrices (Transformer.prepare_backend), so it comes before any step.
"""

from __future__ import annotations

import numpy as np

from service.backends.base import Backend
from service.gguf.reader import GGUFFile
from service.model.dspark_heads import gathered_rows
from service.model.eagle3 import D2T, Eagle3Spec
from service.model.transformer import Transformer
from service.model.weights import _fused


class Eagle3Model:
    def __init__(self, spec: Eagle3Spec, f: GGUFFile, target: Transformer, *, n_ctx: int,
                 n_slots: int, max_tokens: int, type_k: str = "f16", type_v: str = "f16",
                 max_logits: int | None = None):
        spec.check_target(target.spec, str(f.path))
        if spec.has_rope_freqs:
            raise NotImplementedError(f"{f.path}: rope_freqs (Llama-3 RoPE scaling) in an "
                                      "EAGLE-3 drafter is not supported yet")
        be: Backend = target.backend
        self.spec, self.backend, self.max_tokens = spec, be, max_tokens
        # logits rows a call returns at most (a drafter needs 1; default every row)
        self.max_logits = max_tokens if max_logits is None else max_logits
        t, vec = f.tensor, lambda name: be.load_vector(f.tensor(name))
        self.fc = be.load_matrix([t("fc.weight")])                       # (E, 3Et)
        self.enc_norm = vec("enc.output_norm.weight") if spec.norm_before_fc else None
        self.attn_norm, self.attn_norm_2 = vec("blk.0.attn_norm.weight"), vec(
            "blk.0.attn_norm_2.weight")
        self.ffn_norm, self.output_norm = vec("blk.0.ffn_norm.weight"), vec("output_norm.weight")
        self.qkv = _fused(be, [t("blk.0.attn_q.weight"), t("blk.0.attn_k.weight"),
                               t("blk.0.attn_v.weight")])               # (Q+2K, 2E)
        self.wo = be.load_matrix([t("blk.0.attn_output.weight")])        # (E, Q)
        self.gate_up = _fused(be, [t("blk.0.ffn_gate.weight"), t("blk.0.ffn_up.weight")])
        self.down = be.load_matrix([t("blk.0.ffn_down.weight")])         # (E, F)
        self.embedding = (be.load_embedding(t("token_embd.weight")) if spec.own_embedding
                          else target.weights.embedding)
        self.output = (be.load_matrix([t("output.weight")]) if spec.own_output
                       else target.weights.output)                      # (Vd, E)
        self.d2t = f.index_tensor(D2T) if spec.has_d2t else None        # (Vd,) i64 host
        # the embeddings by draft row (a chain on the device feeds its argmax, a draft row,
        # straight back): with d2t the rows d2t[i] gathered at load, of the same type, so
        # embedding row i here is embedding d2t[i] there bit for bit
        self.embedding_draft = self.embedding
        if self.d2t is not None:
            src = f if spec.own_embedding else target.file
            self.embedding_draft = be.load_embedding(
                gathered_rows(src.tensor("token_embd.weight"), self.d2t))   # (Vd, E)
        s, m, z = spec, max_tokens, be.zeros
        self.cache = be.new_kv_cache(1, n_slots, n_ctx, s.n_head_kv, s.head_dim, s.head_dim,
                                     type_k, type_v)
        self.rope = be.rope_table(n_ctx, s.rope_dims, s.rope_base)
        self.Q, self.K = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        self.ws_f = z((m, 3 * s.n_embd_target))                          # (M, 3Et) f32 normed
        self.ws_h = z((m, 2 * s.n_embd))                                  # (M, 2E) f32 [e|gn]
        self.ws_qkv = z((m, self.Q + 2 * self.K))                         # (M, Q+2K) f32
        self.ws_attn = z((m, self.Q))                                     # (M, Q) f32
        self.ws_y = z((m, s.n_embd))                                      # (M, E) f32 residual
        self.ws_o = z((m, s.n_embd))                                      # (M, E) f32 scratch
        self.ws_n = z((m, s.n_embd))                                      # (M, E) f32 normed
        self.ws_e = z((m, s.n_embd))                                      # (M, E) f32 embeds
        self.ws_gu = z((m, 2 * s.n_ff))                                   # (M, 2F) f32
        self.ws_act = z((m, s.n_ff))                                      # (M, F) f32
        self.ws_logits = z((self.max_logits, s.draft_vocab))              # (L, Vd) f32
        # the backend's scratch was sized for the target's matrices: again over the head's
        # (its fc is 3 Et wide), before any step runs
        target.prepare_backend()

    def encode(self, features, g) -> None:
        """g (T, E) = fc @ features (T, 3 Et); both backend arrays."""
        T = features.shape[0]
        x = features
        if self.enc_norm is not None:
            x = self.ws_f[:T]
            self.backend.rms_norm_for_matmul(features, self.enc_norm, self.spec.rms_eps, x)
        self.backend.matmul(x, self.fc, g)                               # (T, E)

    def decode(self, ids, positions, slots, kv_len: int, g, n_logits: int = 1, *,
               by_row: bool = False):
        """One decoder step of T = len(ids) rows conditioned on g (T, E); returns the logits
        (n_logits, Vd) of the last n_logits rows. `self.ws_y[:T]` then holds the pre-norm
        outputs (T, E). ids, positions, slots: (T,) int32 backend arrays; ids are target ids,
        or draft rows with by_row (an argmax's output, read through embedding_draft)."""
        s, be, eps = self.spec, self.backend, self.spec.rms_eps
        T, E, F = len(ids), s.n_embd, s.n_ff
        if not 1 <= T <= self.max_tokens or not 0 <= n_logits <= min(T, self.max_logits):
            raise ValueError(f"EAGLE-3 step of {T} rows / {n_logits} logits (max "
                             f"{self.max_tokens} / {self.max_logits})")
        h, y, o, n = self.ws_h[:T], self.ws_y[:T], self.ws_o[:T], self.ws_n[:T]
        e = self.ws_e[:T]
        table = self.embedding_draft if by_row else self.embedding
        be.embed(table, ids, 1.0, e)                                     # (T, E)
        be.rms_norm(e, self.attn_norm, eps, h[:, :E])                    # (T, E) of (T, 2E)
        be.rms_norm(g, self.attn_norm_2, eps, h[:, E:])                  # (T, E) of (T, 2E)
        qkv = self.ws_qkv[:T]
        for w, c0, c1 in self.qkv:
            be.matmul(h, w, qkv[:, c0:c1])                               # (T, Q+2K)
        hd = s.head_dim
        q = qkv[:, :self.Q].reshape(T, s.n_head, hd)                     # (T, H, hd)
        k = qkv[:, self.Q:self.Q + self.K].reshape(T, s.n_head_kv, hd)   # (T, Hkv, hd)
        v = qkv[:, self.Q + self.K:].reshape(T, s.n_head_kv, hd)         # (T, Hkv, hd)
        be.rope_kv(q, k, v, None, None, eps, positions, slots, self.rope, False, self.cache, 0)
        a = self.ws_attn[:T]
        be.attention_for_matmul(q, self.cache, 0, slots, positions, kv_len, 0,
                                1.0 / float(np.sqrt(hd)), a.reshape(T, s.n_head, hd))
        be.copy_rows(h[:, E:] if s.norm_before_residual else g, y)       # r = gn or g
        be.matmul_add(a, self.wo, y, o)                                  # r += a Wo^T
        be.rms_norm_for_matmul(y, self.ffn_norm, eps, n)                 # (T, E)
        gu, act = self.ws_gu[:T], self.ws_act[:T]
        for w, c0, c1 in self.gate_up:
            be.matmul(n, w, gu[:, c0:c1])                                # (T, 2F)
        be.glu_for_matmul(gu[:, :F], gu[:, F:], "silu", act)             # (T, F)
        be.matmul_add(act, self.down, y, o)                              # r += down
        return self.head(y[T - n_logits:])

    def head(self, y):
        """logits (T, Vd) = output @ (rms_norm(y) * output_norm) of pre-norm rows y (T, E)
        (decode's last op: the same ops on the same rows give the same bits)."""
        T = y.shape[0]
        if T > self.max_logits:
            raise ValueError(f"EAGLE-3 head of {T} rows (max {self.max_logits})")
        if T == 0:
            return self.ws_logits[:0]
        hs = self.ws_n[:T]
        self.backend.rms_norm_for_matmul(y, self.output_norm, self.spec.rms_eps, hs)
        logits = self.ws_logits[:T]
        self.backend.matmul(hs, self.output, logits)                     # (T, Vd)
        return logits
