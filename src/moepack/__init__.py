"""moepack: the bytes of Mixture-of-Experts checkpoints.

Library first: every command of the ``moepack`` CLI is a function here that takes plain
arguments and returns a result object. Nothing in the library prints.
"""

__version__ = "0.1.0"
