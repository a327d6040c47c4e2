"""Request bodies in the content codings clients use (zstd, gzip, deflate,
br): decoded within a bound, and encoded again.

A decompression bomb (a small body that inflates past anything the proxy
plans) must cost little: decoding stops once the output passes
``MAX_DECODED`` (the planning limit) or a ratio times the compressed bytes
read so far (``MAX_RATIO``; ``STREAMED_RATIO`` where the decoding runs on the
event loop; ``MIN_ALLOWANCE`` at least), and each step of a decoder yields a
bounded amount, so that a decode never holds more than its allowance plus one
step (zstd: about 2 MiB, zlib: 1 MiB; brotli, whose library has no output
limit before 1.2: one 16-byte step, measured at 16 MiB at most).
"""

from __future__ import annotations

import zlib
from typing import Any

import brotli
import zstandard

CODINGS = ("zstd", "gzip", "deflate", "br")
MAX_DECODED = 64 * 1024 * 1024
MAX_RATIO = 1024
STREAMED_RATIO = 64  # a 64 KiB chunk then costs 4 MiB of decoding at most
MIN_ALLOWANCE = 1024 * 1024
STEP = 1024 * 1024  # output per zlib step
_ZSTD_BLOCK = 128 * 1024  # the most one zstd block yields; a block takes 4 bytes at least
_ZSTD_MAX_SLICE = 64 * 1024
_BROTLI_SLICE = 16
# The fastest levels: a body is re-encoded for one upload (a few % larger than
# at the default levels, three to seven times faster).
_ZSTD_LEVEL, _ZLIB_LEVEL, _BROTLI_QUALITY = 1, 1, 1


class Refused(Exception):
    """A body not decoded: past the bound, malformed or truncated."""


def coding_of(header: str) -> str | None:
    """The one coding of ``CODINGS`` a Content-Encoding names, or None
    (absent, identity, another, or several stacked)."""
    value = header.strip().lower()
    return value if value in CODINGS else None


class Decoder:
    """One body's decoding, fed as it comes; ``Refused`` once past the bound
    or not well formed."""

    def __init__(self, coding: str, ratio: int = MAX_RATIO) -> None:
        self._engine: Any = {"zstd": _Zstd, "gzip": _Gzip, "deflate": _Deflate, "br": _Brotli}[coding]()
        self._ratio = ratio
        self._read = 0
        self._pieces: list[bytes] = []
        self.size = 0

    def allowance(self) -> int:
        return min(MAX_DECODED, max(MIN_ALLOWANCE, self._ratio * self._read))

    def feed(self, data: bytes) -> None:
        self._read += len(data)
        try:
            for piece in self._engine.steps(memoryview(data), self.allowance() - self.size):
                if piece:
                    self._pieces.append(piece)
                    self.size += len(piece)
                    if self.size > self.allowance():
                        raise Refused(f"decodes past {self.allowance()} bytes")
        except (zlib.error, zstandard.ZstdError, brotli.error) as e:
            self._pieces = []  # what still refers to the error must not hold the output
            raise Refused(type(e).__name__) from None
        except Refused:
            self._pieces = []
            raise

    def finish(self) -> bytes:
        if self._read and not self._engine.finished():  # an empty body is empty in every coding
            self._pieces = []
            raise Refused("truncated")
        body, self._pieces = b"".join(self._pieces), []
        return body


def decode(body: bytes, coding: str) -> bytes:
    """A whole body decoded, or ``Refused``."""
    decoder = Decoder(coding)
    decoder.feed(body)
    return decoder.finish()


def encode(body: bytes, coding: str) -> bytes:
    if coding == "zstd":
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(body)
    if coding == "gzip":
        c = zlib.compressobj(_ZLIB_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        return c.compress(body) + c.flush()
    if coding == "deflate":
        return zlib.compress(body, _ZLIB_LEVEL)
    if coding == "br":
        return brotli.compress(body, quality=_BROTLI_QUALITY)
    raise ValueError(coding)


class _Zstd:
    """Frame after frame (a body may hold several); input in slices small
    enough that one call cannot yield much past what is still allowed."""

    def __init__(self) -> None:
        self._context = zstandard.ZstdDecompressor(max_window_size=MAX_DECODED)
        self._frame: Any = None  # None between frames

    def steps(self, data: memoryview, room: int):
        pos = 0
        while pos < len(data):
            if self._frame is None:
                self._frame = self._context.decompressobj()
            size = min(_ZSTD_MAX_SLICE, max(64, 4 * max(room, 0) // _ZSTD_BLOCK))
            out = self._frame.decompress(data[pos:pos + size])
            pos += size
            room -= len(out)
            yield out
            if self._frame.eof:
                rest = self._frame.unused_data
                self._frame = None
                if rest:
                    data, pos = memoryview(bytes(rest) + bytes(data[pos:])), 0

    def finished(self) -> bool:
        return self._frame is None or self._frame.eof


class _Zlib:
    """zlib's own output limit bounds each step."""

    def __init__(self, wbits: int | None = None) -> None:
        self._wbits = wbits
        self._stream: Any = None
        self._ended = False

    def _open(self, data: memoryview) -> Any:
        return zlib.decompressobj(self._wbits)

    def steps(self, data: memoryview, room: int):
        while data:
            if self._stream is None:
                if self._ended and not self._members():
                    raise zlib.error("data after the end of the stream")
                self._stream = self._open(data)
            buffer: bytes | memoryview = data
            while True:
                out = self._stream.decompress(buffer, STEP)
                buffer = self._stream.unconsumed_tail
                yield out
                if self._stream.eof or not buffer and len(out) < STEP:  # at the end the tail is kept too
                    break
            data = memoryview(b"")
            if self._stream.eof:
                data, self._stream, self._ended = memoryview(self._stream.unused_data), None, True

    def _members(self) -> bool:
        return False

    def finished(self) -> bool:
        return self._stream is None or self._stream.eof


class _Gzip(_Zlib):
    def __init__(self) -> None:
        super().__init__(16 + zlib.MAX_WBITS)

    def _members(self) -> bool:
        return True  # a gzip body may be several members one after the other


class _Deflate(_Zlib):
    """``deflate`` is zlib-wrapped by the standard, raw from some clients."""

    def _open(self, data: memoryview) -> Any:
        raw = (data[0] & 0x0F) != 8 or (data[0] << 8 | (data[1] if len(data) > 1 else 0)) % 31 != 0
        return zlib.decompressobj(-zlib.MAX_WBITS if raw else zlib.MAX_WBITS)


class _Brotli:
    def __init__(self) -> None:
        self._stream = brotli.Decompressor()

    def steps(self, data: memoryview, room: int):
        for pos in range(0, len(data), _BROTLI_SLICE):
            yield self._stream.process(data[pos:pos + _BROTLI_SLICE])

    def finished(self) -> bool:
        return self._stream.is_finished()
