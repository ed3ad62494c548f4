"""llama-cpp-python's JSON-schema-to-grammar converter, mended where its grammars are not JSON.

Every chat handler of llama-cpp-python 0.3.36 makes the grammar of a tool call or a
``response_format`` schema with ``llama_grammar.json_schema_to_gbnf``, a port of an older
``json_schema_to_grammar.py`` of llama.cpp. Two of its constants have since been corrected in
llama.cpp and are corrected here (``mend``, once per process, before any request):

- a string's characters are ``[^"\\\\]``: a raw control character (a newline, a NUL) may
  stand in a string, which no strict JSON parser reads — a forced call's arguments then came
  back as text (plain) or as ``input_json_delta``s the Anthropic SDK could not parse
  (streamed). Now they are what JSON allows: no ``"``, ``\\\\`` or control character unescaped,
  and escapes as JSON has them; the ``.`` of a ``pattern`` likewise;
- literals (property names, ``enum`` and ``const`` values, written as JSON text) are quoted
  for GBNF escaping ``"``, newlines and returns but not backslashes: a name holding a quote
  gave a grammar llama.cpp cannot parse, and one holding a newline a raw newline in the
  answer's JSON; a value holding U+0000 asked the model for a NUL character, which no token
  can give (llama.cpp then aborted). Backslashes are escaped too now, so a literal is the JSON
  text itself (``\\u0000`` as six characters).

``grammar_of`` is the converter as the handlers call it, mended first: ``checks`` judges the
grammar a request will really be sampled with.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

STRING_CHAR = (
    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
    r"[0-9a-fA-F])"
)
"""A JSON string's character, as llama.cpp's own ``json-schema-to-grammar`` writes it."""
PATTERN_DOT = r'[^"\\\x7F\x00-\x1F]'
"""A ``pattern``'s ``.`` inside a JSON string (the converter's allowed quotes and controls)."""
_lock = threading.Lock()
_mended = False


def mend() -> None:
    """Correct the converter's constants (see the module docstring); idempotent."""
    global _mended
    with _lock:
        if _mended:
            return
        from llama_cpp import llama_grammar as g

        g.PRIMITIVE_RULES["char"] = g.BuiltinRule(STRING_CHAR, [])
        g.DOT = PATTERN_DOT
        g.GRAMMAR_LITERAL_ESCAPE_RE = re.compile(r'[\r\n"\\]')
        g.GRAMMAR_LITERAL_ESCAPES = {**g.GRAMMAR_LITERAL_ESCAPES, "\\": "\\\\"}
        _mended = True


def grammar_of(schema: Any) -> str:
    """The GBNF grammar llama-cpp-python's chat handlers make of ``schema`` (mended); raises
    what the converter raises on a schema it cannot convert."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    mend()
    return str(json_schema_to_gbnf(json.dumps(schema)))
