"""stateful-responses: a mitmproxy addon that keeps conversation state for
agents talking to LLM APIs.

One package per capability, each with its mitmproxy glue in ``addon.py`` and
a pure core that never imports mitmproxy:

* ``forward``: full-history requests continued with ``previous_response_id``
  where the upstream provably stored the prefix.
* ``store_emulation``: the proxy keeps the chain for clients that send
  ``previous_response_id`` to upstreams that store nothing, forget or ignore it.
* ``record``: one continuation record per LLM API call, any protocol.
* ``websocket``: full-history requests continued over a socket the proxy holds
  to the upstream's WebSocket mode, which needs no storage.
* ``router``: several upstreams, chains kept where their state lives.
* ``state``: what outlives the process, behind one storage interface.

``pipeline`` lists the addons in hook order; the modules at the top hold what
they share (settings, tenant identity, what is known of each upstream, the
request reader, items, answer reading). ``emulator`` is not the addon: it is a
stand-in for the APIs, the tests' and the demo's upstream.
"""
