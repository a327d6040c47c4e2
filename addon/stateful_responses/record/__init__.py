"""The continuation record (seed 003): one record per LLM API call, whatever
its protocol, and its audit. ``protocols`` lifts four APIs, ``index`` makes
chains, ``addon`` is the mitmproxy glue and the record file."""
