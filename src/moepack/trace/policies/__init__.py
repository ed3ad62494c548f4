"""Cache policies, one module each (``moepack.trace.cache_policy.POLICIES``)."""
