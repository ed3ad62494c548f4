"""``python -m moepack``: the same command as ``moepack``, interrupt handling first."""

from moepack.entry import main

main()
