"""The router: several upstreams, each chain kept where its state lives.
``routes`` decides from the continuation record alone, ``addon`` is the
mitmproxy glue (probes, failover)."""
