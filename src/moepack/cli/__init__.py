"""The ``moepack`` command line: parsing and rendering only; the library computes."""
