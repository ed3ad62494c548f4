"""Expert streaming: cache policies and predictors in registries, and trace replay through
an expert cache with real reads (``moepack replay``)."""
