"""Request bodies decoded within the bound, in each coding clients use: whole
or fed in chunks, several frames or members, truncated, followed by garbage,
and bombs, each stopped at its allowance plus one bounded step."""

from __future__ import annotations

import gzip
import json
import os
import zlib

import brotli
import pytest
import zstandard
from stateful_responses.request_encoding.codec import (
    CODINGS,
    MAX_DECODED,
    MIN_ALLOWANCE,
    STREAMED_RATIO,
    Decoder,
    Refused,
    coding_of,
    decode,
    encode,
)

MiB = 1024 * 1024
BODY = json.dumps({"model": "m", "input": [{"role": "user", "content": f"turn {i} {os.urandom(40).hex()}"}
                                           for i in range(3000)]}).encode()


@pytest.mark.parametrize("coding", CODINGS)
def test_each_coding_round_trips_whole_and_in_chunks(coding):
    data = encode(BODY, coding)
    assert len(data) < len(BODY) and decode(data, coding) == BODY
    decoder = Decoder(coding)
    for i in range(0, len(data), 1000):
        decoder.feed(data[i:i + 1000])
    assert decoder.finish() == BODY
    assert decode(b"", coding) == b""


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("damage", ["truncated", "garbage after", "not that coding"])
def test_a_damaged_body_is_refused(coding, damage):
    data = encode(BODY, coding)
    data = {"truncated": data[:-7], "garbage after": data + b"\x01junk", "not that coding": BODY}[damage]
    with pytest.raises(Refused):
        decode(data, coding)


def test_several_zstd_frames_and_gzip_members_are_one_body_and_raw_deflate_is_read():
    assert decode(zstandard.ZstdCompressor().compress(b'{"a":') + zstandard.ZstdCompressor().compress(b"1}"),
                  "zstd") == b'{"a":1}'
    assert decode(gzip.compress(b'{"a":') + gzip.compress(b"1}"), "gzip") == b'{"a":1}'
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode(raw.compress(b'{"raw":1}') + raw.flush(), "deflate") == b'{"raw":1}'


def test_the_content_encoding_names_one_coding_or_none():
    assert coding_of(" ZSTD ") == "zstd" and coding_of("br") == "br"
    assert coding_of("") is coding_of("identity") is coding_of("gzip, br") is coding_of("compress") is None


# The most one step may yield past the allowance: zstd 17 blocks of 128 KiB, zlib 1 MiB, brotli one meta-block.
STEP = {"zstd": 17 * 128 * 1024, "gzip": MiB, "deflate": MiB, "br": 16 * MiB}


@pytest.mark.parametrize("coding", CODINGS)
def test_a_bomb_stops_at_the_ratio_with_one_step_held_at_most(coding):
    data = encode(bytes(70 * MiB), coding)
    decoder = Decoder(coding)
    with pytest.raises(Refused):
        decoder.feed(data)
    allowance = min(MAX_DECODED, max(MIN_ALLOWANCE, 1024 * len(data)))
    assert allowance < decoder.size <= allowance + STEP[coding]


def test_a_bomb_past_the_planning_limit_stops_there():
    data = encode(b"x" * (70 * MiB), "gzip")  # gzip cannot pass about 1000:1: the ratio allows more than 64 MiB
    assert 1024 * len(data) > MAX_DECODED
    decoder = Decoder("gzip")
    with pytest.raises(Refused):
        decoder.feed(data)
    assert MAX_DECODED < decoder.size <= MAX_DECODED + STEP["gzip"]


def test_decoding_on_the_event_loop_keeps_a_stricter_ratio():
    data = encode(b"x" * (8 * MiB), "zstd")
    chunk = os.urandom(64 * 1024) + data  # an incompressible start: the allowance grows with it
    decoder = Decoder("zstd", STREAMED_RATIO)
    with pytest.raises(Refused):
        for i in range(0, len(chunk), 64 * 1024):
            decoder.feed(chunk[i:i + 64 * 1024])
    assert decoder.size <= STREAMED_RATIO * len(chunk) + STEP["zstd"]


def test_a_zstd_frame_asking_for_a_window_past_the_limit_is_refused():
    """Its decoder would hold that window: 128 MiB asked by a few bytes."""
    stream = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(window_log=27)) \
        .compressobj()
    data = stream.compress(b'{"a":1}') + stream.flush()
    assert zstandard.get_frame_parameters(data).window_size > MAX_DECODED
    with pytest.raises(Refused):
        decode(data, "zstd")


def test_brotli_streams_of_a_bomb_are_fed_in_small_steps():
    data = brotli.compress(bytes(24 * MiB))  # the best ratio brotli has
    decoder = Decoder("br")
    with pytest.raises(Refused):
        decoder.feed(data)
    assert decoder.size <= MIN_ALLOWANCE + STEP["br"]


# -- the glue, in-process --------------------------------------------------------------------------

def compressed_flow(body: dict, coding: str = "zstd"):
    from test_addon import responses_flow

    data = encode(json.dumps(body).encode(), coding)
    flow = responses_flow(data)
    flow.request.headers["content-encoding"] = coding
    return flow, data


async def through(addon, flow) -> None:
    """The request hooks of decoding, forward mode and encoding, in order."""
    await addon.decoding.request(flow)
    await addon.forward.request(flow)
    await addon.encoding.request(flow)


async def test_forward_mode_plans_a_compressed_body_and_its_change_goes_in_the_clients_coding():
    from test_addon import Glue

    async with Glue() as addon:
        changed, _ = compressed_flow({"model": "m", "input": "hello"})  # the store is forced: a change
        await through(addon, changed)
        assert changed.request.headers["content-encoding"] == "zstd"
        assert json.loads(decode(changed.request.raw_content, "zstd"))["store"] is True
        assert changed.request.headers["content-length"] == str(len(changed.request.raw_content))
        untouched, data = compressed_flow({"model": "m", "input": "hello", "store": True})
        await through(addon, untouched)
        assert untouched.request.raw_content == data and untouched.request.headers["content-encoding"] == "zstd"
        damaged, _ = compressed_flow({"model": "m", "input": "hello"})
        damaged.request.raw_content = damaged.request.raw_content[:-3]
        before = damaged.request.raw_content
        await through(addon, damaged)
        assert damaged.request.raw_content == before and damaged.request.headers["content-encoding"] == "zstd"
        assert damaged.metadata["stateful"]["reason"] == "compressed request body"


async def test_a_streamed_compressed_body_is_decoded_for_forward_mode_and_goes_in_the_clients_coding():
    from mitmproxy.addons.proxyserver import Proxyserver
    from test_addon import Glue

    async with Glue() as addon:
        addon.tctx.master.addons.add(Proxyserver())  # it owns stream_large_bodies
        addon.tctx.options.update(stream_large_bodies="1k")
        flow, data = compressed_flow({"model": "m", "input": os.urandom(4096).hex()})
        flow.request.headers["content-length"] = str(len(data))
        addon.decoding.requestheaders(flow)
        await addon.forward.requestheaders(flow)
        addon.encoding.requestheaders(flow)
        assert flow.request.headers["content-encoding"] == "zstd" and callable(flow.request.stream)
        out = b"".join(b"".join(flow.request.stream(data[i:i + 1000])) for i in range(0, len(data), 1000))
        out += b"".join(flow.request.stream(b""))
        assert json.loads(decode(out, "zstd"))["store"] is True  # planned decoded, sent encoded
        await through(addon, flow)
        assert flow.request.raw_content == out and flow.request.headers["content-encoding"] == "zstd"
