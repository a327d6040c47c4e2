"""Reading answers on the side: SSE framing, encodings, JSON, broken input."""

from __future__ import annotations

import gzip
import json
import zlib

import brotli
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st
from stateful_responses.emulator import sse_events
from stateful_responses.answer_reader import AnswerReader, SSEParser

RESPONSE = {"id": "resp_1", "status": "completed", "store": True, "output": [
    {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
     "content": [{"type": "output_text", "text": "hello there", "annotations": []}]}]}


def stream_bytes(newline: str = "\n") -> bytes:
    out = []
    for event in sse_events(json.loads(json.dumps(RESPONSE))):
        out.append(f"event: {event['type']}{newline}data: {json.dumps(event)}{newline}{newline}")
    return b": keep-alive comment\n\n" + "".join(out).encode()


def read(data: bytes, chunks: list[int], content_type="text/event-stream", encoding="") -> dict | None:
    reader = AnswerReader(content_type, encoding)
    pos = 0
    for size in chunks:
        reader.feed(data[pos:pos + size])
        pos += size
    reader.feed(data[pos:])
    reader.feed(b"")
    return reader.finish()


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
def test_line_endings(newline):
    assert read(stream_bytes(newline), []) == RESPONSE


@given(st.lists(st.integers(1, 400), max_size=40), st.sampled_from(["\n", "\r\n", "\r"]))
def test_events_split_anywhere(chunks, newline):
    assert read(stream_bytes(newline), chunks) == RESPONSE


def test_multiline_data_and_missing_event_names():
    payload = json.dumps({"type": "response.completed", "response": RESPONSE}, indent=1)
    data = "".join(f"data: {line}\n" for line in payload.splitlines()) + "\n"
    assert read(data.encode(), [7, 3]) == RESPONSE
    assert SSEParser().feed(b"data: a\ndata: b\n\n") == [("", "a\nb")]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate", "br", "zstd"])
def test_content_encoded_streams(encoding):
    raw = stream_bytes()
    if encoding == "gzip":
        data = gzip.compress(raw)
    elif encoding == "deflate":
        data = zlib.compress(raw)
    elif encoding == "raw-deflate":
        c = zlib.compressobj(wbits=-15)
        data, encoding = c.compress(raw) + c.flush(), "deflate"
    elif encoding == "br":
        data = brotli.compress(raw)
    else:
        data = zstandard.ZstdCompressor().compress(raw)
    assert read(data, [5] * 50, encoding=encoding) == RESPONSE


def test_output_from_item_events_when_the_terminal_event_has_none():
    events = sse_events(json.loads(json.dumps(RESPONSE)))
    events[-1]["response"]["output"] = []
    data = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()
    assert read(data, [])["output"] == RESPONSE["output"]


def test_json_answer():
    assert read(json.dumps(RESPONSE).encode(), [3, 3], content_type="application/json") == RESPONSE


@pytest.mark.parametrize(
    ("data", "content_type", "encoding"),
    [
        (b"<html>502</html>", "text/html", ""),
        (b"\xff\xfe\x00garbage", "application/json", ""),
        (b"data: {broken\n\n", "text/event-stream", ""),
        (b"not gzip at all", "text/event-stream", "gzip"),
        (b"data: x\n\n", "text/event-stream", "compress"),
    ],
    ids=["html", "binary", "broken-event", "bad-gzip", "unknown-encoding"],
)
def test_unreadable_answers_give_up_quietly(data, content_type, encoding):
    assert read(data, [2], content_type, encoding) is None


def test_cut_stream_ends_without_a_completed_response():
    data = stream_bytes()
    cut = data[: data.index(b"event: response.completed")]
    assert read(cut, [])["status"] == "in_progress"


@pytest.mark.parametrize(
    "tamper",
    [
        lambda text: text.replace('"id": "resp_1"', '"id": "resp_1", "id": "resp_other"'),
        lambda text: text.replace('"text": "hello there"', '"text": "hello there", "text": "bye"'),
        lambda text: text.replace('"text": "hello there"', '"text": "hello \\ud800there"'),
        lambda text: text.replace('"status": "completed"', '"status": NaN, "status": "completed"', 1),
    ],
    ids=["duplicate-id", "duplicate-text", "lone-surrogate", "nan"],
)
@pytest.mark.parametrize("kind", ["json", "sse"])
def test_answers_another_parser_reads_differently_teach_nothing(tamper, kind):
    """What the addon learns is what every client reads."""
    if kind == "json":
        data = tamper(json.dumps(RESPONSE)).encode()
        assert read(data, [5], content_type="application/json") is None
    else:
        data = tamper(stream_bytes().decode()).encode()
        assert read(data, [50]) is None


def test_invalid_utf8_in_an_event_teaches_nothing():
    data = stream_bytes().replace(b"hello there", b"hello \xff there")
    assert read(data, []) is None
