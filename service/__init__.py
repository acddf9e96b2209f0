"""specstream: stream tokens from GGUF language models over gRPC."""

__version__ = "0.1.0"
