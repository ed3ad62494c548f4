"""Layout plug-ins: one module per layout, each defining ``PLUGIN`` (see ``..layout``)."""
