"""Expert-major stores: each routed expert's slices in one aligned record, with an index.

``open_store`` is the reading interface (replay reads one request per expert from it);
``build_store`` writes a store from a GGUF, ``verify_store`` checks one against its model.
"""

from .reader import ExpertStore, StoredExpert, StoredPart, open_store

__all__ = ["ExpertStore", "StoredExpert", "StoredPart", "open_store"]
