"""NPU2 packing for Qwen3.6-35B-A3B: ``.q4nx`` tiles into the runtime's device buffers.

The central type is ``LayoutProfile`` (``profile.py``): one module per runtime layout in
``profiles/``, applied by one shared packer (``plan`` compiles placements into index arrays,
``gather`` moves bytes with ``np.take``). Around it: the ``.q4nx`` container (``q4nx``), tile
codecs (``codecs``), synthetic models (``synth``), pack / unpack (``packer``, ``unpack``), dump
verification (``verify``), instruction-stream decoding (``txn``), and a slow reference packer
(``refpacker``) that cross-checks the fast one.
"""

from .profile import LayoutProfile, Placement, Provenance, Status
from .profiles import all_profiles, get_profile

__all__ = ["LayoutProfile", "Placement", "Provenance", "Status", "all_profiles", "get_profile"]
