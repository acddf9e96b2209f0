"""DSpark's heads on a backend (llama.cpp's draft-dspark; the formulas in dflash.py): the Markov
head chained along a DFlash block, and the optional confidence head.

    chain(ids, logits, best)    for i = first .. T - 1 (first = spec.first_draft_row):
                                    r_i = s * W1[prev_i]               embed, (1, R)
                                    logits[i] += r_i @ W2^T            matmul_add, (1, Vd)
                                    best[i] = argmax(logits[i])        the draft row's pick
                                prev_first = ids[0] (the anchor, a target id: W1's rows), then
                                best[i - 1], a draft row: with d2t its W1 row is W1[d2t[best]],
                                read from W1d = W1[d2t] (rows gathered at load), so the chain
                                runs on the backend with no host round trip
    confidence(h, T)            c_i = sigmoid(conf_proj . [h_i ; W1[prev_i]] + b) for the chain's
                                rows (h (T, E): the block rows' rms_norm(x) * output_norm), one
                                matmul over the rows, the sigmoid on the host: (T - first,) f32

llama.cpp multiplies W2's product by the scale s; here s scales the gathered row before it (the
same up to the rounding of activations for quantized W2, which 8-bit block quantization keeps
scale-equivariant). The confidence reads W1[prev] unscaled, as llama.cpp's does. Every buffer
is allocated at construction.
"""

from __future__ import annotations

import numpy as np

from service.backends.base import Backend
from service.gguf.quants import dequantize
from service.gguf.reader import GGUFFile, TensorInfo
from service.model.dflash import CONF_B, CONF_W, D2T, MARKOV_SCALE, MARKOV_W1, MARKOV_W2, DflashSpec


def _scalar(f: GGUFFile, name: str) -> float:
    info = f.tensor(name, (1,))
    return float(dequantize(info.raw, info.qtype, info.shape)[0])


def gathered_rows(info: TensorInfo, rows: np.ndarray) -> TensorInfo:
    """Rows `rows` of a 2-D tensor (any type: a row is whole blocks) as a tensor of their own."""
    n = info.shape[0]
    raw = np.ascontiguousarray(info.raw.reshape(n, -1)[rows]).reshape(-1)   # (len(rows) rb,) u8
    return TensorInfo(f"{info.name}[d2t]", info.qtype, (len(rows), *info.shape[1:]), raw)


class DsparkHeads:
    def __init__(self, spec: DflashSpec, f: GGUFFile, be: Backend, max_block: int):
        if not spec.dspark:
            raise ValueError("DsparkHeads: not a DSpark drafter")
        self.spec, self.backend = spec, be
        R, E, B = spec.markov_rank, spec.n_embd, max_block
        w1 = f.tensor(MARKOV_W1, (spec.vocab_size, R))
        self.w1 = be.load_embedding(w1)                                      # (V, R) by id
        self.w1_draft = (be.load_embedding(gathered_rows(w1, f.index_tensor(D2T)))
                         if spec.has_d2t else self.w1)                      # (Vd, R) by row
        self.w2 = be.load_matrix([f.tensor(MARKOV_W2, (spec.draft_vocab, R))])  # (Vd, R)
        self.scale = _scalar(f, MARKOV_SCALE) if spec.markov_scale else 1.0
        self.ws_r = be.zeros((B, R))                                         # (B, R) f32 s W1
        self.ws_tmp = be.zeros((1, spec.draft_vocab))                        # (1, Vd) f32
        if spec.confidence:
            self.conf = be.load_matrix([f.tensor(CONF_W, (1, E + R))])     # (1, E + R)
            self.conf_bias = _scalar(f, CONF_B) if spec.confidence_bias else 0.0
            self.ws_feat = be.zeros((B, E + R))                              # (B, E + R) f32
            self.ws_w1 = be.zeros((1, R))                                    # (1, R) f32 W1
            self.ws_conf = be.zeros((B, 1))                                  # (B, 1) f32

    def chain(self, ids, logits, best) -> None:
        """The Markov chain over the block's logits (T, Vd), in place; best (>= T,) int32 gets
        each chain row's argmax (draft rows). ids (T,) int32: the block's ids (ids[0] the
        anchor). With the confidence head, the rows' W1[prev] are kept for confidence()."""
        s, be = self.spec, self.backend
        E, T, first = s.n_embd, logits.shape[0], s.first_draft_row
        for i in range(first, T):
            table, prev = (self.w1, ids[0:1]) if i == first else (self.w1_draft, best[i - 1:i])
            r = self.ws_r[i:i + 1]
            be.embed(table, prev, self.scale, r)                             # (1, R)
            be.matmul_add(r, self.w2, logits[i:i + 1], self.ws_tmp)          # (1, Vd)
            be.argmax(logits[i:i + 1], best[i:i + 1])
            if s.confidence:
                w1 = r
                if self.scale != 1.0:
                    w1 = self.ws_w1
                    be.embed(table, prev, 1.0, w1)                           # (1, R)
                be.copy_rows(w1, self.ws_feat[i:i + 1, E:])

    def confidence(self, h, T: int) -> np.ndarray:
        """c (T - first,) f32 of the rows chain() last ran over (T rows); h (>= T, E) f32: the
        block rows' final hidden states."""
        s, be = self.spec, self.backend
        E, first = s.n_embd, s.first_draft_row
        if not s.confidence:
            raise ValueError("confidence: the drafter has no confidence head")
        feat, out = self.ws_feat[first:T], self.ws_conf[first:T]
        be.copy_rows(h[first:T], feat[:, :E])
        be.matmul(feat, self.conf, out)                                      # (T', 1)
        z = np.asarray(be.to_host(out), np.float32)[:, 0] + np.float32(self.conf_bias)
        return (np.float32(1) / (np.float32(1) + np.exp(-z))).astype(np.float32)
