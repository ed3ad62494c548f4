"""Dequantisation engines: one module per engine, each defining ``PLUGIN``."""
