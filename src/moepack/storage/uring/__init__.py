"""io_uring for the read engines: a small ctypes ring, and checks of the PyPI bindings."""
