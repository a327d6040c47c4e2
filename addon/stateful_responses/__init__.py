"""stateful-responses: continue full-history OpenAI Responses API requests with
``previous_response_id`` when, and only when, the upstream provably stored the
prefix. ``items``, ``store``, ``planner``, ``settings`` and ``sse`` are the pure
core (no mitmproxy); ``addon`` is the mitmproxy glue."""
