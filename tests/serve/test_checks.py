"""The request checks both APIs call (``serve.checks``), in process: a grammar's nesting read
past its literals, classes and comments; a schema's repetition counts summed wherever they
sit; sampling numbers refused as JSON gives them (floats, huge, strings, booleans) with the
field named; ``logit_bias`` keys and values; grammars over the size and nesting caps refused
before llama.cpp parses them; and llama-cpp-python's schema converter, mended, writing JSON
literals and strings a strict parser reads."""

from __future__ import annotations

import json

import pytest

from moepack.serve.checks import (
    MAX_GRAMMAR_BYTES,
    Limits,
    RequestChecks,
    Vocabulary,
    nesting,
    repetitions,
)


def _checks(verdict: str | None = None) -> RequestChecks:
    seen: list[str] = []

    def grammar(text: str) -> str | None:
        seen.append(text)
        return verdict

    checks = RequestChecks(Vocabulary(n_vocab=262, longest_piece=4, grammar=grammar),
                           Limits(n_ctx=1024, max_prompt_tokens=1024))  # fmt: skip
    checks.seen = seen  # type: ignore[attr-defined]
    return checks


def test_nesting_counts_groups_outside_literals_classes_and_comments():
    assert nesting('root ::= (("a"))') == 2
    assert nesting('root ::= "((" [(] "\\"(" ( x ) # (((\nx ::= "y"') == 1
    assert nesting("root ::= " + "(" * 30_000 + '"a"' + ")" * 30_000) == 30_000
    assert nesting('root ::= "unterminated ((') == 0


def test_repetitions_sum_every_count_of_a_schema():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 100, "pattern": "^a{3,7}b{2}c{4,}$"},
        "b": {"type": "array", "minItems": 5, "items": {"type": "string", "minLength": 9}},
    }}  # fmt: skip
    assert repetitions(schema) == 100 + 7 + 2 + 4 + 5 + 9
    assert repetitions({"anyOf": [{"maxItems": 10**30}]}) > 10**12
    assert repetitions({"pattern": "^a{" + "9" * 5000 + "}$"}) > 10**12  # no int() of it
    assert repetitions({"maxLength": "many", "minItems": -5}) == 0


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"seed": 1.5}, "`seed` must be an integer"),
        ({"seed": 1e30}, "`seed` must be 0 to 4,294,967,295"),
        ({"seed": -1}, "`seed` must be 0 to"),
        ({"seed": 2**32}, "got 4294967296"),
        ({"seed": True}, "`seed` must be an integer, got true"),
        ({"seed": "5"}, '`seed` must be an integer, got "5"'),
        ({"temperature": -0.5}, "`temperature` must be at least 0"),
        ({"top_p": 2}, "`top_p` must be 0 to 1"),
        ({"top_k": 2**40}, "`top_k` must be 0 to 2,147,483,647"),
        ({"min_p": "x"}, "`min_p` must be a number"),
        ({"presence_penalty": 1e9}, "`presence_penalty` must be -2 to 2"),
    ],
)
def test_sampling_numbers_are_refused_as_json_gives_them(fields, words):
    problem = _checks().numbers(fields)
    assert problem is not None and problem.status == 400
    assert words in problem.message and problem.param == next(iter(fields)), problem


def test_sampling_numbers_within_range_and_unknown_fields_pass():
    checks = _checks()
    assert checks.numbers({"seed": 0, "temperature": 0, "top_p": 1, "max_tokens": 5}) is None
    assert checks.numbers({"seed": 7.0, "seed_extra": "x", "temperature": None}) is None


@pytest.mark.parametrize(
    ("bias", "code", "words"),
    [
        ([5], None, "an object"),
        ({"x": 1}, None, "keys are token ids"),
        ({"1.5": 1}, None, "keys are token ids"),
        ({"99999": 1}, "invalid_token_id", "token id 99999 is not in the vocabulary"),
        ({"-1": 1}, "invalid_token_id", "token id -1"),
        ({"5": 1000}, None, "lie in [-100, 100]"),
        ({"5": "nan"}, None, "values are numbers"),
        ({"5": True}, None, "values are numbers"),
        ({"7" * 5000: 1}, None, "keys are token ids"),  # no int() of it: Python refuses
    ],
)
def test_logit_bias_keys_and_values(bias, code, words):
    problem = _checks().logit_bias(bias)
    assert problem is not None and problem.code == code and words in problem.message, problem
    assert problem.param == "logit_bias"


def test_grammars_over_the_caps_never_reach_llama_cpp():
    checks = _checks()
    big = checks.grammar("root ::= " + '"a" ' * (MAX_GRAMMAR_BYTES // 4), "grammar")
    deep = checks.grammar("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "grammar")
    for problem in (big, deep):
        assert problem is not None and problem.code == "invalid_grammar"
    assert checks.seen == []  # type: ignore[attr-defined]
    refused = _checks("llama.cpp cannot parse this grammar")
    problem = refused.grammar("root ::= [", "grammar")
    assert problem is not None and "cannot parse" in problem.message and problem.param == "grammar"
    assert _checks().grammar('root ::= "a"', "grammar") is None


def test_a_schema_asking_too_many_repetitions_is_never_converted():
    checks = _checks()
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 10**8}
    problem = checks.schema(schema, "tools")
    assert problem is not None and "repetitions" in problem.message
    assert checks.seen == []  # type: ignore[attr-defined]


def test_the_mended_converter_writes_json_literals_and_strict_strings():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    from moepack.serve.schema_grammar import grammar_of

    named = grammar_of({"type": "object", "properties": {'a"b\\c\nd': {"type": "string"}}})
    key = json.dumps('a"b\\c\nd')  # the key's JSON text, backslashes and all, as one literal
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    assert f'"{escaped}"' in named
    assert "\\x00-\\x1F" in named  # a string's characters: no raw control characters
    assert '"\\"\\\\u0000\\""' in grammar_of({"const": "\u0000"})  # six characters, not a NUL
