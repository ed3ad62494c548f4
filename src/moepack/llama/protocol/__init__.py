"""The worker protocol: every llama.cpp run is a child process started here (events over a pipe,
interrupts forwarded, death with the parent, owner-named scratch folders), and traces are
spooled to disk as they are computed."""
