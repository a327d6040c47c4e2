"""The ``stateful-responses`` command.

``stateful-responses [UPSTREAM] [mitmdump options…]`` runs mitmdump in reverse
mode in front of UPSTREAM (default https://api.openai.com) with the addon, in
this Python, where the addon's dependencies are installed.
``stateful-responses --script`` prints the path of the entry script, for
``mitmdump -s`` or ``mitmweb -s`` (any mode).
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_UPSTREAM = "https://api.openai.com"
SCRIPT = Path(__file__).resolve().with_name("mitmproxy_script.py")
USAGE = f"""usage: stateful-responses [UPSTREAM] [mitmdump options…]
       stateful-responses --script

Run mitmdump as a reverse proxy in front of UPSTREAM (default {DEFAULT_UPSTREAM}) with the
stateful-responses addon, then point clients at OPENAI_BASE_URL=http://127.0.0.1:8080/v1.
Every other option goes to mitmdump (--listen-port, --set stateful_store=…, …).

--script   print the path of the addon's entry script, for mitmdump -s / mitmweb -s"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--script"]:
        print(SCRIPT)
        return 0
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    upstream = args.pop(0) if args and not args[0].startswith("-") else DEFAULT_UPSTREAM
    from mitmproxy.tools.main import mitmdump  # here: --script and --help work without it

    mitmdump(["--mode", f"reverse:{upstream}", "-s", str(SCRIPT), *args])
    return 0


if __name__ == "__main__":
    sys.exit(main())
