"""Quant block specs: one registered class per GGML type, vectorized numpy dequantization.

INTERFACE (being implemented; see tests/unit/test_quants.py):

class QuantType(enum.IntEnum): F32=0, F16=1, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12,
    Q5_K=13, Q6_K=14, BF16=30   (values are ggml's type ids)

@dataclass(frozen=True) class BlockSpec: qtype, block_size (elements), type_size (bytes),
    bits (4 or 8: width of the integer codes after `affine()`; 32 for float types)
    dequantize(raw: (n_blocks, type_size) uint8) -> (n_blocks, block_size) float32, bit-exact
        with gguf.quants.dequantize
    affine(raw) -> (codes (n_blocks, block_size) int8, scale (n_blocks, block_size//group) f32,
        offset (same) f32, group) with value == scale*code + offset  (float types: None)

block_spec(qtype) -> BlockSpec | None
dequantize(raw: uint8 bytes, qtype, shape) -> float32 array of `shape`
"""
