"""Whose request this is: tenant identity, shared by every capability.

A tenant is whatever decides whose stored responses a request can reach: its
credential headers, the URL's query string and the user mitmproxy's
``proxyauth`` let in (``credential_material``). It enters anything stored or
logged only through keyed hashes under the store's secret, shared by every
proxy using the store and never logged: the credential itself is never kept,
and a digest cannot be tested offline.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from blake3 import blake3

from .bounded import Bounded

if TYPE_CHECKING:
    from .request_reader import Request

# Headers that identify whose stored responses a request can reach. Upstreams
# scope stored responses by credential (and organization / project); a proxy
# credential tells users of one shared proxy apart. The URL's query string is
# credential material too (some gateways take keys there).
CREDENTIAL_HEADERS = (
    "authorization",
    "api-key",
    "x-api-key",
    "openai-organization",
    "openai-project",
    "proxy-authorization",
)
# Other APIs and gateways name their keys as they like (Gemini's x-goog-api-key,
# Azure API Management's Ocp-Apim-Subscription-Key, Portkey's x-portkey-api-key,
# Cloudflare AI Gateway's cf-aig-authorization, Helicone-Auth): a header named
# like a credential is one. An idempotency key names a request, not a tenant;
# cookies are left out (services rotate theirs, Cloudflare's every 30 minutes,
# and a chain recorded under one would be lost under the next). A WebSocket
# handshake's headers (Sec-WebSocket-Key, a fresh nonce on every upgrade) name
# a socket, not a tenant.
_NAMED_LIKE_A_CREDENTIAL = re.compile(r"auth|key|token|secret|password|subscription")


def is_credential_header(name: str) -> bool:
    """Whether a header (its lower-case name) is credential material."""
    return name in CREDENTIAL_HEADERS or _named_like_a_credential(name)


def _named_like_a_credential(name: str) -> bool:
    return _NAMED_LIKE_A_CREDENTIAL.search(name) is not None and "idempotency" not in name \
        and not name.startswith("sec-websocket-")


def credential_material(request: Request) -> bytes:
    """Whatever decides whose stored responses a request can reach: the
    credential headers, the URL's query string, and the user mitmproxy's
    proxyauth let in (it removes Proxy-Authorization before addons run)."""
    headers = request.headers
    parts = [headers.get(n, "") for n in CREDENTIAL_HEADERS]
    parts += [urlsplit(request.url).query, request.proxy_user]
    parts += sorted(f"{name}: {value}" for written, value in headers.items()
                    if (name := written.lower()) not in CREDENTIAL_HEADERS and _named_like_a_credential(name))
    return "\x00".join(parts).encode("utf-8", "surrogatepass")


class Tenancy:
    """The store's secret, and the keyed names derived from it.

    Until the backing store's secret arrives, a random one of this process
    stands in. When the secret changes, whatever was learned under the old one
    is unreachable: the pieces that keep such knowledge subscribe to forget it.
    """

    def __init__(self) -> None:
        self._secret = os.urandom(32)
        self._from_store = False
        self.older_secrets: tuple[bytes, ...] = ()  # what the store used before: still readable
        self.seal_key = b""  # a key that does not live in the store, mixed into every seal (see options)
        self._scopes = Bounded(1024)  # (upstream, credential) -> (scope, label)
        self._forget: list[Callable[[], None]] = []

    @property
    def secret(self) -> bytes:
        """The keyed-hash secret (the backing store's once connected): never logged."""
        return self._secret

    @property
    def store_secret(self) -> bytes | None:
        """The secret this process took from the store, if it has one yet."""
        return self._secret if self._from_store else None

    def on_new_secret(self, forget: Callable[[], None]) -> None:
        """Call ``forget`` whenever the secret changes."""
        self._forget.append(forget)

    def use_secret(self, secret: bytes, older: tuple[bytes, ...] = ()) -> None:
        """Hash with the backing store's secret from now on, so that every
        process sharing the store names sequences and scopes alike; ``older``
        are the secrets it used before, whose records stay readable."""
        self._from_store = True
        self.older_secrets = tuple(s for s in older if s != secret)
        if secret != self._secret:
            self._secret = secret
            self._scopes.clear()
            for forget in self._forget:
                forget()

    def scope(self, upstream: str, credential: bytes) -> tuple[str, str]:
        """One upstream as seen by one credential: where what the addon learns
        about an upstream applies. Zero data retention is decided per
        organization, so one such tenant must not switch the addon off for
        every other tenant of the same upstream.

        Returns the scope (a keyed hash) and its label for logs: scheme, host
        and hash tags, never the path (some gateways take keys there) nor
        anything of the credential."""
        known = self._scopes.get((upstream, credential))
        if known is not None:
            return known
        upstream_bytes = upstream.encode("utf-8", "surrogatepass")
        scope = blake3(upstream_bytes + b"\x00" + credential, key=self._secret).hexdigest(16)
        parts = urlsplit(upstream)
        host = parts.hostname or "?"
        if parts.port:
            host = f"{host}:{parts.port}"
        upstream_tag = blake3(upstream_bytes, key=self._secret).hexdigest(3)
        credential_tag = blake3(credential, key=self._secret).hexdigest(4)
        result = scope, f"{parts.scheme}://{host} (upstream #{upstream_tag}, credential #{credential_tag})"
        self._scopes.put((upstream, credential), result)
        return result
