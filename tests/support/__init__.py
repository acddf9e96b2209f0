"""What the tests build, each kind in one place: model files and Transformers (models), engines
and single requests (engines), batches of requests (batching), the scripted engine of the
service tests (fake_engine), servers and `specstream serve` subprocesses (grpc_harness), the CLI
in-process (cli), random quantized blocks (blocks), GGUF files written by a test (gguf_files),
the near-tie rule for greedy ids (near_ties), logits comparisons (logits) and fused-op inputs
(fused)."""
