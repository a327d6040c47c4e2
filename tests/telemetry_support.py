"""What the telemetry tests share: scraping ``/metrics`` into samples, a real
Prometheus server on loopback scraping the proxy, and an OTLP receiver that
decodes the spans the exporter sends (opentelemetry-proto)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from harness import free_port, wait_listening
from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as answer:
        return answer.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, by name and sorted labels (the ``_created`` ones left out)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls))


class PrometheusServer:
    """Debian's prometheus on loopback, scraping ``targets`` every second."""

    def __init__(self, directory: Path, targets: list[str]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus")
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config = directory / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "stateful-responses", "static_configs": [{"targets": targets}]}],
        }))
        self.log = open(directory / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_listening(self.port, self.process, "prometheus", lambda: (directory / "prometheus.log").read_text(),
                           timeout=60)
        except BaseException:
            self.stop()
            raise

    def query(self, expression: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with urllib.request.urlopen(url, timeout=30) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scraped_up(self, timeout: float = 120) -> None:
        """Until the proxy's target was scraped and found up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if [r for r in self.query("up") if r["value"][1] == "1"]:
                    return
            except urllib.error.HTTPError as error:
                if error.code != 503:  # 503: its storage is still starting (a loaded machine takes seconds)
                    raise
            time.sleep(0.5)
        raise AssertionError("prometheus never scraped the proxy")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log.close()


class OtlpReceiver:
    """An OTLP/HTTP receiver on loopback: each ``POST /v1/traces`` decoded
    (protobuf) into spans, kept with their attributes as plain values."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        receiver = self
        self.spans: list[dict] = []
        self.bodies: list[bytes] = []
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver._lock:
                    receiver.bodies.append(body)
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            for span in scope.spans:
                                receiver.spans.append({
                                    "name": span.name,
                                    "attributes": {a.key: _plain(a.value) for a in span.attributes},
                                    "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                                    "resource": {a.key: _plain(a.value) for a in resource.resource.attributes},
                                })
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_for(self, count: int, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.2)
        with self._lock:
            return list(self.spans)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _plain(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_plain(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
