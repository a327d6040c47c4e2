"""The WebSocket bridge: full-history HTTP clients of the Responses API
continued over a socket the proxy holds to the upstream's WebSocket mode,
which keeps the latest response in memory and needs no storage. Glue in
``addon.py``; the rest never imports mitmproxy."""
