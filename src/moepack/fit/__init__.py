"""``moepack fit``: will this model run on this machine, and how fast — before the download
(a URL's header and tensor index over HTTP Range) and checked after it (``verify``).

The parts: ``remote`` (the index over HTTP), ``header`` (how long a GGUF header is),
``shapes`` (what of a model decides its speed), ``device`` (the storage measured once per
device), ``calibrate`` (compute per token for a model's per-layer shapes, measured in
llama.cpp on a generated model), ``hitrate`` (the expert cache's hits from a trace or from
priors), ``estimate`` (the cost model), ``verify`` (the runs that check it) and ``command``
(``fit_model``, what the command calls).
"""
