"""mitmproxy entry script of a checkout: ``mitmdump -s addon/stateful_responses.py``.

It runs the package's own entry script, ``stateful_responses/mitmproxy_script.py``
(the one an installed wheel is loaded from), so both behave alike: the package
is purged on every hot reload, and a missing dependency is one clear message.
"""

import os
import runpy

addons = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "stateful_responses",
                                     "mitmproxy_script.py"))["addons"]
