"""The RoPE cos/sin table both backends upload (load time, on the host).

Plain RoPE: angle pos * base^(-2i/n_dims) for pair i < n_dims/2. With `scaling` (a
service.model.spec.RopeScaling), the angle is YaRN's as ggml's rope_yarn computes it: the
interpolated angle (x freq_scale) and the extrapolated one are mixed per pair by a ramp that is
1 below the correction dim of beta_fast and 0 above that of beta_slow (times ext_factor), and
cos/sin are multiplied by attn_factor * (1 + 0.1 ln(1 / freq_scale)) when ext_factor != 0.
"""

from __future__ import annotations

import math

import numpy as np


def _corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def rope_cos_sin(n_ctx: int, n_dims: int, base: float, scaling=None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (n_ctx, n_dims/2) f32."""
    inv = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)        # (n_dims/2,)
    pos = np.arange(n_ctx, dtype=np.float64)[:, None]
    mscale = 1.0
    if scaling is None:
        ang = pos * inv[None, :]                                                # (n_ctx, d/2)
    else:
        extrap = pos * inv[None, :]
        interp = extrap * scaling.freq_scale
        ang = interp
        mscale = scaling.attn_factor
        if scaling.ext_factor != 0.0:
            lo = max(0.0, math.floor(_corr_dim(n_dims, scaling.n_ctx_orig, scaling.beta_fast,
                                               base)))
            hi = min(n_dims - 1.0, math.ceil(_corr_dim(n_dims, scaling.n_ctx_orig,
                                                       scaling.beta_slow, base)))
            i = np.arange(n_dims // 2, dtype=np.float64)
            ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)      # (d/2,)
            mix = ramp * scaling.ext_factor
            ang = interp * (1.0 - mix) + extrap * mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / scaling.freq_scale)
    return ((np.cos(ang) * mscale).astype(np.float32),
            (np.sin(ang) * mscale).astype(np.float32))
