"""Streaming, atomic GGUF rewriting (repack) and whole-file verification."""
