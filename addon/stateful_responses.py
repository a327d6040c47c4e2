"""mitmproxy entry script: ``mitmdump -s addon/stateful_responses.py``.

The logic lives in the ``stateful_responses`` package beside this file (a
package directory wins over this module of the same name on import). mitmproxy's hot
reload re-runs only this script, so the package is purged from ``sys.modules``
first and every reload picks up package changes too.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    # mitmproxy puts the script's folder on sys.path only while loading it.
    sys.path.insert(0, _here)
for _name in [n for n in sys.modules if n == "stateful_responses" or n.startswith("stateful_responses.")]:
    del sys.modules[_name]

from stateful_responses.addon import make_addons  # noqa: E402

addons = make_addons()
