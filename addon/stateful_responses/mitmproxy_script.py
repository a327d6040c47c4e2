"""mitmproxy entry script: ``mitmdump -s "$(stateful-responses --script)"``.

The one entry script there is: an installed wheel is loaded from here, and a
checkout's ``addon/stateful_responses.py`` runs this file. mitmproxy's hot
reload re-runs only the script, so the package is purged from ``sys.modules``
first and every reload picks up package changes too. A mitmproxy whose Python
lacks a dependency (standalone binaries, Homebrew, ``pipx install mitmproxy``)
ends with one message saying what is missing and how to install it, not a
traceback: mitmdump exits on any error logged while it starts.
"""

import logging
import os
import sys

_package = os.path.dirname(os.path.abspath(__file__))
# mitmproxy puts a script's folder first on sys.path (and leaves it there).
# Here that folder is the package itself, whose modules (settings, storage,
# options, …) would shadow top-level modules of the same names.
while _package in sys.path:
    sys.path.remove(_package)
_parent = os.path.dirname(_package)
if _parent not in sys.path:  # a checkout, or a wheel loaded by another Python
    sys.path.insert(0, _parent)
for _name in [n for n in sys.modules if n == "stateful_responses" or n.startswith("stateful_responses.")]:
    del sys.modules[_name]


def _requirement(module: str) -> str:
    """The addon's own requirement for ``module`` (its bounds), where the addon is installed in this
    Python; else the bare name (every dependency's package is named as its module)."""
    from importlib import metadata

    try:
        requirements = metadata.requires("stateful-responses") or []
    except metadata.PackageNotFoundError:
        return module
    for requirement in requirements:
        name = requirement.split(";")[0]
        for stop in "<>=!~ [(":
            name = name.split(stop)[0]
        if name.strip().lower().replace("-", "_") == module.lower():
            return requirement.split(";")[0].replace(" ", "")
    return module


def _addon_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("stateful-responses")
    except metadata.PackageNotFoundError:
        return False
    return True


def missing_dependency_message(module: str) -> str:
    """What to tell someone whose mitmproxy cannot import ``module``: the package and the command that
    installs it into the environment that lacks it."""
    if getattr(sys, "frozen", False):
        return (f"stateful-responses needs the Python package {module!r}, and mitmproxy's standalone "
                "binaries bring their own Python that cannot load it: install mitmproxy with pipx or uv "
                "instead, with the addon beside it: `pipx install mitmproxy && pipx inject mitmproxy "
                "stateful-responses`, or `uv tool install mitmproxy --with stateful-responses`.")
    install = f"`{sys.executable} -m pip install '{_requirement(module)}'`"
    if _addon_installed():
        return (f"stateful-responses needs the Python package {module!r}, which this mitmproxy's Python "
                f"({sys.executable}) lacks although the addon is installed there: {install} installs it.")
    return (f"stateful-responses needs the Python package {module!r}, which this mitmproxy's Python "
            f"({sys.executable}) lacks: {install} installs it. Better, install the addon itself into "
            "mitmproxy's environment, which brings every package it needs: "
            "`pipx inject mitmproxy stateful-responses` (mitmproxy from pipx), "
            "`uv tool install mitmproxy --with stateful-responses` (from uv), or "
            f"`{sys.executable} -m pip install stateful-responses` (a checkout's path or a git URL "
            "works in place of the name). mitmproxy's standalone binaries cannot load it.")


try:
    from stateful_responses.pipeline import make_addons
except ModuleNotFoundError as error:
    missing = (error.name or "").partition(".")[0]
    if not missing or missing == "stateful_responses":
        raise
    logging.getLogger("stateful_responses").error(missing_dependency_message(missing))
    addons: list = []
else:
    addons = make_addons()
