"""The CPU reference backend: `backend.CpuBackend`, composed of parts that each own their state
(attention with the KV cache, matmul with the weights, the numpy ops, the reference sample op,
the numba kernels). Importing the package loads none of them."""
