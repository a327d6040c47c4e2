"""The verdicts of the questions the addon asks an upstream before relying on
it (through real mitmdump in tests/test_gateway_integration.py and the
emulation tests; here, what each answer means)."""

import json

import pytest
from stateful_responses.proofs import read_the_chain, reads_back

RESPONSE = json.dumps({"id": "resp_1", "object": "response", "output": []}).encode()


@pytest.mark.parametrize(("status", "body", "verdict"), [
    (200, RESPONSE, True),
    (200, b"<html>ok</html>", False),  # a gateway's page, not a response
    (200, json.dumps({"id": "resp_1"}).encode(), False),
    (404, b'{"error": {"message": "not found"}}', False),
    (400, b'{"error": {"code": "400"}}', False),
    (408, b"", None), (429, b"", None), (500, RESPONSE, None), (503, b"", None),  # not now: ask again later
])
def test_a_stored_response_read_back_proves_the_upstream_stores(status, body, verdict):
    assert reads_back(status, body) is verdict


def listing(n: int, more: bool = False) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": f"msg_{k}"} for k in range(n)], "has_more": more}).encode()


@pytest.mark.parametrize(("status", "body", "verdict"), [
    (200, listing(3), True),  # more than the one item sent: the chain was read
    (200, listing(1, more=True), True),
    (200, listing(1), False),  # only what was sent: the field was ignored
    (404, b"{}", None), (200, b"not json", None), (200, b"{}", None),  # no listing: unknown
])
def test_an_answers_input_items_tell_whether_it_read_its_chain(status, body, verdict):
    assert read_the_chain(status, body, items_sent=1) is verdict
