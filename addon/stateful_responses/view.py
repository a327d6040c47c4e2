"""The mitmweb / mitmproxy contentview: for a matched flow, the decision and the
client's original body beside the body sent upstream.

mitmproxy 12 has ``contentviews.Contentview`` (``prettify``); mitmproxy 11 has
``contentviews.View`` (``__call__``). One renderer, two thin adapters.
"""

from __future__ import annotations

import json

from mitmproxy import contentviews

from .flows import AUDIT, BRIDGED, CLIENT_BODY, CONTINUATION, DECISION

NAME = "Stateful Responses"


def _pretty(data: bytes) -> str:
    try:
        return json.dumps(json.loads(data), indent=2, ensure_ascii=False)
    except ValueError:
        return data.decode("utf-8", "replace")


def _record_lines(flow) -> list[str]:
    record = flow.metadata.get(CONTINUATION)
    if not record:
        return []
    lines = ["", "--- continuation record ---", json.dumps(record, indent=2)]
    mapping = (flow.metadata.get(AUDIT) or {}).get("protocolMapping") or {}
    for disposition, entries in mapping.items():
        for entry in entries:
            lines.append(f"{disposition}: {entry['field']}: {entry['reason']} ({entry['source']})")
    return lines


def _bridged_lines(bridged: dict) -> list[str]:
    """What went over the upstream WebSocket (the body shown is the client's: it went as a response.create)."""
    if bridged.get("transport") != "websocket":
        retries = "; ".join(bridged.get("retries") or [])
        return [f"transport: HTTP: the upstream's WebSocket could not answer it ({retries})"]
    lines = [f"transport: the upstream's WebSocket, {bridged.get('action')}"]
    if bridged.get("previous_response_id"):
        lines.append(f"previous_response_id: {bridged['previous_response_id']} (the socket's latest response)")
    lines.append(f"items: {bridged.get('items_sent', '?')} sent of {bridged.get('items_total', '?')}")
    lines += [f"retried: {why}" for why in bridged.get("retries") or []]
    return lines


def render(flow, data: bytes) -> str:
    if DECISION not in flow.metadata:  # a bridged flow, or another protocol's call: its record and its body
        bridged = flow.metadata.get(BRIDGED)
        head = _bridged_lines(bridged) + _record_lines(flow) if bridged else _record_lines(flow)[1:]
        return "\n".join(head + ["", f"--- body ({len(data)} bytes) ---", _pretty(data)])
    decision = flow.metadata.get(DECISION, {})
    lines = [f"decision: {decision.get('action', '?')} ({decision.get('reason', '')})"]
    if decision.get("previous_response_id"):
        lines.append(f"previous_response_id: {decision['previous_response_id']}")
    lines.append(f"items: {decision.get('items_sent', '?')} sent of {decision.get('items_total', '?')}")
    if decision.get("forced_store"):
        lines.append("store: true forced by the addon")
    if "outcome" in decision:
        lines.append(f"answer: {decision['outcome']} ({decision.get('outcome_detail', '')})"
                     + (f" -> {decision['response_id']}" if decision.get("response_id") else ""))
    if decision.get("retried_after"):
        lines.append(f"upstream answered {decision['retried_after']}; retried with the client's original body")
    lines += _record_lines(flow)
    original = flow.metadata.get(CLIENT_BODY)
    if original is None:
        lines += ["", f"--- body (unchanged, {len(data)} bytes) ---", _pretty(data)]
    else:
        lines += ["", f"--- client sent ({len(original)} bytes) ---", _pretty(original),
                  "", f"--- sent upstream ({len(data)} bytes) ---", _pretty(data)]
    return "\n".join(lines)


def _ours(flow) -> bool:
    return flow is not None and (DECISION in flow.metadata or BRIDGED in flow.metadata
                                 or bool(flow.metadata.get(CONTINUATION)))


def _is_our_request(flow, message) -> bool:
    return _ours(flow) and message is getattr(flow, "request", None)


if hasattr(contentviews, "Contentview"):  # mitmproxy >= 12

    class StatefulView(contentviews.Contentview):
        name = NAME
        syntax_highlight = "yaml"

        def prettify(self, data: bytes, metadata) -> str:
            if not _ours(metadata.flow):
                raise ValueError("not a flow stateful-responses matched")
            return render(metadata.flow, data)

        def render_priority(self, data: bytes, metadata) -> float:
            return 2 if _is_our_request(metadata.flow, metadata.http_message) else -1

else:  # mitmproxy 11

    class StatefulView(contentviews.View):  # type: ignore[no-redef]
        name = NAME

        def __call__(self, data: bytes, *, flow=None, **metadata):
            if not _ours(flow):
                raise ValueError("not a flow stateful-responses matched")
            return NAME, ([("text", line)] for line in render(flow, data).splitlines())

        def render_priority(self, data: bytes, *, flow=None, http_message=None, **metadata) -> float:
            return 2 if _is_our_request(flow, http_message) else 0


class ContentView:
    """The addon that keeps the view registered while the script is loaded."""

    def __init__(self) -> None:
        self._view: StatefulView | None = None

    def load(self, loader) -> None:
        # Replace a view left by an earlier load of the script (mitmproxy 11
        # refuses a duplicate name).
        existing = contentviews.get(NAME)
        if existing is not None and not hasattr(contentviews, "Contentview"):
            contentviews.remove(existing)
        self._view = StatefulView()
        contentviews.add(self._view)

    def done(self) -> None:
        if self._view is not None:
            contentviews.remove(self._view)  # a no-op on mitmproxy 12, whose registry replaces by name
            self._view = None
