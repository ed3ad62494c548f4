"""The expert prefetcher that runs inside a llama.cpp process: the eval gate and callback, the C
read-ahead and live cache, lookahead, pinning of dense weights and the mapping it works on.
Nothing here starts a process or loads a model; the runtime above does."""
