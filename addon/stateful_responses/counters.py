"""What the addon did, counted: ``stateful.stats`` and the line at shutdown."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    requests: int = 0
    continued: int = 0
    delta_items: int = 0
    full_items: int = 0
    bytes_saved: int = 0
    retries: int = 0
    fallbacks: int = 0
    unsupported_upstreams: int = 0
    ambiguous: int = 0
    websocket_turns: int = 0  # requests answered over an upstream WebSocket
    websocket_retries: int = 0  # of which retried invisibly after a socket failed or refused
    client_websocket_sockets: int = 0  # client sockets the proxy served WebSocket mode on (an upstream lacking it)
    client_websocket_turns: int = 0  # their response.create turns sent over HTTP
    errors: int = 0
