"""Forward mode: a full-history Responses API request becomes
``previous_response_id`` + the new items, only where the upstream provably
stored the prefix. ``planner`` decides, ``prefixes`` remembers, ``addon`` is
the mitmproxy glue."""
