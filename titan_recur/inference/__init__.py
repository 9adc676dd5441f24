"""Decoding: the generation engine (KV cache, per-token depth, exit criteria, warm start)."""
