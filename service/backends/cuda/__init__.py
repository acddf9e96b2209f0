"""The CUDA backend: CuPy launchers for the raw kernels in cuda/, weights quantized on the GPU,
and one captured CUDA graph per step shape.

backend.py is the facade the engine creates (`CudaBackend`); it imports CuPy, as do the parts it
is composed of. layout.py, types.py, kernels.py and sources.py are numpy only (the CPU tests
and the compile check import them), so this package's own import loads nothing.
"""
