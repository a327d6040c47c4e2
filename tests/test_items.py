"""Item equivalence: what counts as the same content, and what never does."""

from __future__ import annotations

import json

import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st
from stateful_responses.items import (
    SEQUENCE_DIGEST_SIZE,
    Ambiguous,
    DigestCache,
    ItemSequence,
    item_digest,
    normalize_item,
    raw_item_digest,
    unambiguous,
)

OUTPUT_MESSAGE = {
    "type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "phase": "final_answer",
    "content": [{"type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []}],
}
FUNCTION_CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                 "arguments": '{"city": "Paris", "days": 2}', "status": "completed"}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}


def same(a, b) -> bool:
    return item_digest(a) == item_digest(b)


@pytest.mark.parametrize(
    ("upstream", "echo"),
    [
        (OUTPUT_MESSAGE, {k: v for k, v in OUTPUT_MESSAGE.items() if k not in ("id", "status")}),
        (OUTPUT_MESSAGE, {**OUTPUT_MESSAGE, "caller": None, "namespace": None}),
        ({**OUTPUT_MESSAGE, "phase": None}, {"role": "assistant", "content": "It is sunny."}),
        ({"role": "user", "content": "hi"},
         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}),
        (FUNCTION_CALL, {**FUNCTION_CALL, "arguments": '{"days":2,"city":"Paris"}', "id": None}),
        (REASONING, {**REASONING, "content": None, "status": None}),
        (FUNCTION_CALL, dict(reversed(list(FUNCTION_CALL.items())))),
    ],
    ids=["ids-status", "null-keys", "easy-assistant", "easy-user", "arguments-whitespace",
         "codex-reasoning", "key-order"],
)
def test_reshaped_echoes_are_equal(upstream, echo):
    assert same(upstream, echo)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (OUTPUT_MESSAGE, {**OUTPUT_MESSAGE, "content": [{"type": "output_text", "text": "It is rainy."}]}),
        (OUTPUT_MESSAGE, {**OUTPUT_MESSAGE, "phase": "commentary"}),
        (OUTPUT_MESSAGE, {k: v for k, v in OUTPUT_MESSAGE.items() if k != "phase"}),
        (OUTPUT_MESSAGE, {**OUTPUT_MESSAGE, "role": "user"}),
        ({"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}),
        (FUNCTION_CALL, {**FUNCTION_CALL, "arguments": '{"city": "Lyon", "days": 2}'}),
        (FUNCTION_CALL, {**FUNCTION_CALL, "arguments": '{"city": "Paris", "days": 2.0}'}),
        (FUNCTION_CALL, {**FUNCTION_CALL, "call_id": "call_2"}),
        (REASONING, {**REASONING, "encrypted_content": "gBBB"}),
        ({"type": "item_reference", "id": "msg_1"}, {"type": "item_reference", "id": "msg_2"}),
        ({"type": "function_call_output", "call_id": "c", "output": "1"},
         {"type": "function_call_output", "call_id": "c", "output": "2"}),
        # A type-less reference is a reference, equal only to itself.
        ({"id": "msg_1"}, {"id": "msg_2"}),
        ({"id": "msg_1", "type": None}, {"id": "msg_2"}),
        # The same key names are content on some item types, and deeper down.
        (REASONING, {**REASONING, "id": "rs_other"}),
        ({"type": "apply_patch_call_output", "call_id": "c", "status": "completed", "output": ""},
         {"type": "apply_patch_call_output", "call_id": "c", "status": "failed", "output": ""}),
        ({"type": "program_output", "status": "ok"}, {"type": "program_output", "status": "error"}),
        ({"type": "local_shell_call_output", "id": "call_1", "output": "ok"},
         {"type": "local_shell_call_output", "id": "call_2", "output": "ok"}),
        ({"type": "mcp_list_tools", "server_label": "s", "tools": [{"name": "t", "annotations": {"readOnlyHint": True}}]},
         {"type": "mcp_list_tools", "server_label": "s", "tools": [{"name": "t", "annotations": {"readOnlyHint": False}}]}),
        ({"type": "mcp_list_tools", "server_label": "s", "tools": [{"name": "t", "annotations": {"readOnlyHint": True}}]},
         {"type": "mcp_list_tools", "server_label": "s", "tools": [{"name": "t"}]}),
        ({"type": "mcp_list_tools", "server_label": "s",
          "tools": [{"name": "t", "input_schema": {"properties": {"x": {"default": None}}}}]},
         {"type": "mcp_list_tools", "server_label": "s",
          "tools": [{"name": "t", "input_schema": {"properties": {"x": {}}}}]}),
        ({"type": "new_kind", "id": "x_1", "status": "a"}, {"type": "new_kind", "id": "x_1", "status": "b"}),
        ({"type": ["odd"], "id": "x_1", "status": "a"}, {"type": ["odd"], "id": "x_1", "status": "b"}),
        (FUNCTION_CALL, {**FUNCTION_CALL, "arguments": '{"city": "Paris", "days": 2.00}'}),
        (FUNCTION_CALL, {**FUNCTION_CALL, "arguments": '{"city": "Paris", "days": 2, "days": 2}'}),
    ],
    ids=["other-text", "other-phase", "dropped-phase", "other-role", "easy-other-role", "other-argument",
         "int-vs-float", "other-call-id", "other-reasoning", "other-reference", "other-tool-result",
         "typeless-references", "null-type-reference", "reasoning-id", "apply-patch-status",
         "program-output-status", "local-shell-output-id", "mcp-tool-annotations", "mcp-tool-annotations-dropped",
         "schema-null-default", "unknown-type-status", "non-string-type", "argument-decimal-scale", "argument-duplicate-key"],
)
def test_changes_of_meaning_are_never_equal(a, b):
    assert not same(a, b)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"type": "message", "role": "user", "role": "assistant", "content": "x"}',
        b'{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a", "text": "b"}]}',
        b'{"type": "function_call_output", "call_id": "c", "output": "\\ud800"}',
        b'{"type": "function_call_output", "call_id": "c", "output": NaN}',
        b'{"type": "function_call_output", "call_id": "c", "output": [1e400]}',
        b'{"type": "function_call_output", "call_id": "c", "output": [1.00000000000000000001]}',
    ],
    ids=["duplicate-key", "duplicate-key-deep", "lone-surrogate", "nan", "overflowing-number", "rounded-number"],
)
def test_items_that_parsers_read_differently_are_ambiguous(raw):
    with pytest.raises(Ambiguous):
        raw_item_digest(raw)


@pytest.mark.parametrize(
    ("a", "b"),
    [("1e400", "1e401"), ("1.00000000000000000001", "1.0"), ("-0", "0"),
     ("123456789012345678901234567890", "123456789012345678901234567891")],
)
def test_numbers_a_parser_would_round_together_never_compare_equal(a, b):
    """Two literals equal only to a rounding parser never compare
    equal: refused as ambiguous (double parsers would round them), or apart."""
    item = b'{"type": "function_call_output", "call_id": "c", "output": [%s]}'
    try:
        assert raw_item_digest(item % a.encode()) != raw_item_digest(item % b.encode())
    except Ambiguous:
        assert not unambiguous(item % a.encode()) or not unambiguous(item % b.encode())


def test_the_digest_cache_checks_an_ambiguous_item_once_and_always_refuses_it():
    cache = DigestCache()
    ambiguous = b'{"role": "user", "content": "a", "content": "b"}'
    for _ in range(2):
        with pytest.raises(Ambiguous):
            cache.digests([b'{"role": "user", "content": "ok"}', ambiguous])
    assert len(cache) == 2


def test_non_json_arguments_compare_as_text():
    bad = {**FUNCTION_CALL, "arguments": "{not json"}
    assert same(bad, {**bad, "id": "x"})
    assert not same(bad, {**FUNCTION_CALL, "arguments": "{not json "})


def test_dropped_reasoning_item_changes_the_sequence():
    # item identity is per item; a dropped item changes the sequence length, never hides in another
    assert not same(REASONING, OUTPUT_MESSAGE)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10,
)


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=5))
def test_normal_form_is_stable_and_idempotent(item):
    once = normalize_item(item)
    assert json.loads(json.dumps(once)) == once
    assert item_digest(item) == item_digest(json.loads(json.dumps(item)))


def rolling_digests(root: bytes, items: list[bytes]) -> list[bytes]:
    """The definition: blake3 of the root and the first k item digests."""
    return [blake3(root + b"".join(items[:k])).digest(SEQUENCE_DIGEST_SIZE) for k in range(1, len(items) + 1)]


@given(st.binary(max_size=40), st.lists(st.binary(min_size=16, max_size=16), max_size=12),
       st.lists(st.one_of(st.integers(-14, 13), st.tuples(st.integers(-14, 14), st.integers(-14, 14))), max_size=12),
       st.lists(st.binary(min_size=16, max_size=16), max_size=3))
def test_prefix_digests_asked_in_any_order_are_the_rolling_digests(root, items, questions, more):
    sequence = ItemSequence(root, items)
    expected = rolling_digests(root, items)
    for question in questions:
        if isinstance(question, tuple):
            assert sequence.digests[question[0]:question[1]] == expected[question[0]:question[1]]
        elif -len(items) <= question < len(items):
            assert sequence.digests[question] == expected[question]
        else:
            with pytest.raises(IndexError):
                sequence.digests[question]
    assert len(sequence.digests) == len(items) and list(sequence.digests) == expected
    longer = sequence.extended(more)
    assert list(longer.digests) == rolling_digests(root, items + more)
    assert list(sequence.digests) == expected  # the original is unchanged
