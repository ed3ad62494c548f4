"""llama.cpp (through llama-cpp-python) as the real runtime: logits, judging drop-in repacks."""
