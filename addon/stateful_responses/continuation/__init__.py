"""The continuation engine: for each full-history Responses request, what
the upstream already holds of it (``planner``), from what every answer
proved stored (``prefixes``). Pure: its transports, HTTP (``forward``) and
the upstream's WebSocket mode (``websocket``), carry the requests and report
every answer back to it."""
