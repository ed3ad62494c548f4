"""Planted routing: synthetic models whose weights plant a routing structure, and the traces
and prompts that go with them. Above ``checkpoint`` (the model) and ``trace`` (the routing),
which it uses."""
