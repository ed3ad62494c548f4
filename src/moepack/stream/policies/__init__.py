"""Cache policies, one module each (``moepack.stream.policy.POLICIES``)."""
