"""Read engines, one module each, defining ``PLUGIN`` or ``PLUGINS`` (``ReadEngine`` objects)."""
