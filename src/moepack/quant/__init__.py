"""Quantisation: dequantisation engines (gguf-py's codecs, ggml's own C codecs) and the
``compare`` of two GGUFs of one model, tensor by tensor and expert by expert."""
