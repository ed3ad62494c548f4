"""Predictors, one module each (``moepack.stream.predictor.PREDICTORS``)."""
