"""Store emulation: for clients that send ``previous_response_id`` to an
upstream that stores nothing, forgets or ignores it, the proxy keeps the chain
(sealed per tenant) and expands it into full history. ``walk`` is seed 000's
chain walk, ``turns`` the sealed records, ``history`` turns in and chains out,
``addon`` the mitmproxy glue."""
