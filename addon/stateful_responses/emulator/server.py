"""HTTP face of the emulator: ``POST /v1/responses`` (JSON or SSE), plus a
control plane under ``/_emulator/`` for tests and the demo.

Control plane:
  ``GET  /_emulator/log``      what it received: bytes, items, continued, context
  ``POST /_emulator/control``  faults and forgetting (see ``model.Faults``)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import socket
import ssl
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .model import APIError, ResponsesModel, sse_events


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            body = self._read_chunked()
        else:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
        self.raw_sha256 = hashlib.sha256(body).hexdigest()
        if self.headers.get("content-encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        return body

    def _read_chunked(self) -> bytes:
        """A chunked request body, as every real HTTP/1.1 server accepts."""
        body = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(body)
            body += self.rfile.read(size)
            self.rfile.readline()

    def _send_json(self, status: int, payload: Any, extra: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        headers = {"content-type": "application/json"}
        if self.server.model.faults.gzip and status < 400:
            data = gzip.compress(data)
            headers["content-encoding"] = "gzip"
        self.send_response(status)
        for k, v in {**headers, **(extra or {})}.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/_emulator/log":
            self._send_json(200, self.server.model.snapshot_log())
        else:
            self._send_json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self) -> None:
        body = self._read_body()
        if self.path == "/_emulator/control":
            self._send_json(200, self.server.model.control(json.loads(body or b"{}")))
            return
        if self.path.split("?")[0].rstrip("/") not in ("/v1/responses", "/responses"):
            self._send_json(404, {"error": {"message": f"Invalid URL (POST {self.path})", "type": "invalid_request_error"}})
            return
        credential = self.headers.get("authorization") or self.headers.get("api-key") or ""
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        try:
            response, fault = self.server.model.handle(credential, parsed, len(body), self.raw_sha256)
        except APIError as e:
            self._send_json(e.status, e.body)
            return
        kind = (fault or {}).get("kind")
        if kind == "reset":
            self._reset_connection()
            return
        if kind == "html":
            data = b"<html><body>502 Bad Gateway</body></html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if parsed.get("stream"):
            self._stream(response, cut_after=(fault or {}).get("after_events") if kind == "cut" else None,
                         terminal_event=(fault or {}).get("terminal_event"))
        else:
            self._send_json(200, response)

    def _reset_connection(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.connection.close()
        self.close_connection = True

    def _stream(self, response: dict, cut_after: int | None, terminal_event: str | None = None) -> None:
        faults = self.server.model.faults
        compress = zlib.compressobj(wbits=16 + zlib.MAX_WBITS) if faults.gzip else None
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("cache-control", "no-cache")
        if compress:
            self.send_header("content-encoding", "gzip")
        self.end_headers()

        def chunk(data: bytes) -> None:
            if compress:
                data = compress.compress(data) + compress.flush(zlib.Z_SYNC_FLUSH)
            if data:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

        sent = bytearray()
        for n, event in enumerate(sse_events(response, terminal_event)):
            if cut_after is not None and n >= cut_after:
                self._reset_connection()
                return
            data = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            sent += data
            self.server.model.record_stream(response["id"], bytes(sent))
            chunk(data)
            if faults.slow_ms:
                time.sleep(faults.slow_ms / 1000)
        if compress:
            tail = compress.flush()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(tail), tail))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], model: ResponsesModel) -> None:
        super().__init__(address, _Handler)
        self.model = model


class Emulator:
    """The emulator in a background thread: ``with Emulator() as emu: emu.url``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, seed: int = 0,
                 certfile: str | None = None, keyfile: str | None = None) -> None:
        self.model = ResponsesModel(seed)
        self._server = _Server((host, port), self.model)
        self.scheme = "http"
        if certfile:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile, keyfile)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, name="responses-emulator", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self) -> Emulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
