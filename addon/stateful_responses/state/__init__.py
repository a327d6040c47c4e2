"""The state layer: what outlives the process. ``storage`` is the interface
and its backends (memory, SQLite, Redis), ``outbox`` the writes the cores hand
out, ``addon`` the mitmproxy glue that writes them and reads what memory lacks."""
