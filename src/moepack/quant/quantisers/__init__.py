"""Quantiser plug-ins (see ``moepack.quant.quantiser``)."""
