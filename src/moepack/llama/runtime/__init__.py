"""The runtime entry points: a llama.cpp session in a worker, routing capture, ``run`` with the
prefetcher, the prompts they read, and the hook that gives the prefetcher to a caller's own
``llama_cpp.Llama``."""
