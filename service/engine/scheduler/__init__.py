"""The scheduler: which sequences run in a step, their KV blocks and slots."""
