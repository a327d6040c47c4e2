"""Forward mode, the continuation engine's HTTP transport: a full-history
Responses API request becomes ``previous_response_id`` + the new items, only
where the upstream provably stored the prefix. The engine
(``continuation``) decides; ``addon`` is the mitmproxy glue."""
