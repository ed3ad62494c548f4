"""``moepack serve``: llama-cpp-python's OpenAI-compatible server with the expert prefetcher,
and Anthropic's Messages API on the same model (``anthropic_api``).

The HTTP side is llama-cpp-python's own application (``llama_cpp.server``: its routes, request
types, chat templates, streaming and error wording); moepack adds the model loaded through
the prefetch hook (``llama.hook``), every pass measured (``meter``), ``/metrics`` in
Prometheus text format (``metrics``), every request checked before llama.cpp sees it and every
error in the API's shape (``guard``, ``validate``, ``shapes``, ``openai_errors``), the routing
of every request spooled to a trace (``tracing``), Anthropic's Messages API
(``anthropic_api``), a dashboard at ``/`` (``dashboard``), one log line per request
(``requestlog``) and ``--api-key`` (``apikey``). It runs in a llama.cpp worker process (``worker``, started through
``llama.child``); ``server.serve_model`` is the library call.
"""
