"""OpenTelemetry spans, one per LLM API call the continuation record saw,
following the GenAI semantic conventions, with the record's chain id as
``gen_ai.conversation.id`` and the proxy's decision as ``stateful.*``
attributes. Never content: no prompt, no output, no credential.

The SDK and its OTLP exporter are the optional ``otel`` extra, imported only
when traces are turned on; the exporter reads the standard
``OTEL_EXPORTER_OTLP_*`` variables, and spans leave from the SDK's batch
processor thread, never from the event loop.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

from .decisions import Counted

EXTRA = "pip install 'stateful-responses[otel]'"
# protocol -> (gen_ai.provider.name, gen_ai.operation.name), as the conventions name them
PROVIDERS = {
    "openai-responses": ("openai", "chat"),
    "openai-chat": ("openai", "chat"),
    "anthropic-messages": ("anthropic", "chat"),
    "gemini-chat": ("gcp.gemini", "generate_content"),
}


class MissingExtra(RuntimeError):
    pass


class CallFacts(Protocol):
    """What a span is made of (``flows.Call``): counts, names and ids only."""

    protocol: str
    model: str | None
    chain_id: str
    response_id: str | None
    status: str | None
    status_code: int | None
    input_tokens: int | None
    output_tokens: int | None
    client_transport: str
    upstream_transport: str
    started: float
    ended: float


def attributes(call: CallFacts, counted: Counted | None, server: str) -> dict[str, Any]:
    """The span's attributes: the GenAI conventions', then the proxy's own."""
    provider, operation = PROVIDERS.get(call.protocol, ("openai", "chat"))
    found: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": provider,
        "gen_ai.conversation.id": call.chain_id,
        "server.address": server,
        "stateful.protocol": call.protocol,
        "stateful.client_transport": call.client_transport,
        "stateful.decision": counted.decision if counted else "passed",
        "stateful.transport": counted.transport if counted else call.upstream_transport,
    }
    optional = {
        "gen_ai.request.model": call.model,
        "gen_ai.response.id": call.response_id,
        "gen_ai.usage.input_tokens": call.input_tokens,
        "gen_ai.usage.output_tokens": call.output_tokens,
        "http.response.status_code": call.status_code,
        "stateful.response_status": call.status,
    }
    found.update({k: v for k, v in optional.items() if v is not None})
    if counted is not None and counted.fallbacks:
        found["stateful.fallbacks"] = list(counted.fallbacks)
    if call.status_code is not None and call.status_code >= 400:
        found["error.type"] = str(call.status_code)
    return found


class Traces:
    def __init__(self) -> None:
        self._provider: Any = None
        self._tracer: Any = None
        self._kind: Any = None
        self._error: Any = None

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def start(self) -> None:
        """Export spans over OTLP (HTTP/protobuf) from a batch processor's thread."""
        if self._tracer is not None:
            return
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
        except ImportError:
            raise MissingExtra(f"stateful_traces=otlp needs the OpenTelemetry SDK and its OTLP exporter: "
                               f"{EXTRA}") from None
        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "stateful-responses"}
        provider = TracerProvider(resource=Resource.create(named))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self._provider, self._tracer = provider, provider.get_tracer("stateful_responses")
        self._kind, self._error = SpanKind.CLIENT, Status(StatusCode.ERROR)

    def span(self, call: CallFacts, counted: Counted | None, server: str) -> None:
        """One finished span for ``call`` (queued: the batch processor exports it)."""
        if self._tracer is None:
            return
        found = attributes(call, counted, server)
        name = f"{found['gen_ai.operation.name']} {call.model}" if call.model else found["gen_ai.operation.name"]
        span = self._tracer.start_span(name, kind=self._kind, attributes=found, start_time=int(call.started * 1e9))
        if "error.type" in found:
            span.set_status(self._error)
        span.end(end_time=int(max(call.ended, call.started) * 1e9))

    def close(self, wait: float) -> None:
        """Export what is queued, then stop: on a thread of its own, waited
        for ``wait`` seconds at most (an unreachable collector holds nobody)."""
        provider, self._provider, self._tracer = self._provider, None, None
        if provider is not None:
            stopping = threading.Thread(target=provider.shutdown, name="stateful-responses-traces", daemon=True)
            stopping.start()
            stopping.join(wait)
