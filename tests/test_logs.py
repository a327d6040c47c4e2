"""What ``logs.quiet_libraries`` lets reach a log handler: the libraries' debug lines not at all, their
warnings without the values put into them, and an exception raised through the addon's code with its
frames and type but never its message; anything else as it was."""

from __future__ import annotations

import logging

import pytest
from stateful_responses import logs

SECRET = "sk-secret prompt text"


@pytest.fixture
def handled():
    """Records as a handler on the root logger gets them (mitmproxy's: every level), quieted as at load."""
    factory = logging.getLogRecordFactory()
    levels = {name: logging.getLogger(name).level for name in logs.LIBRARIES}
    root_level = logging.getLogger().level
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.DEBUG)
    logs.quiet_libraries()
    yield records
    logging.getLogger().removeHandler(handler)
    logging.getLogger().setLevel(root_level)
    logging.setLogRecordFactory(factory)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def text(record: logging.LogRecord) -> str:
    return logging.Formatter().format(record)


def raise_ours() -> None:
    """An exception raised in a frame of the addon's package that quotes a request."""
    exec(compile("def lookup(): {}[secret]\nlookup()", logs._PACKAGE + "somewhere.py", "exec"), {"secret": SECRET})


def test_the_libraries_debug_lines_never_reach_a_handler(handled):
    for name in ("websockets.client", "redis.asyncio.cluster", "push_response", logs.SOCKETS):
        logging.getLogger(name).debug("> %s %s", "authorization:", SECRET)
        logging.getLogger(name).info("connect failed: %s", SECRET)
    assert handled == []


def test_a_library_warning_keeps_its_template_never_its_values(handled):
    try:
        raise ValueError(SECRET)
    except ValueError:
        logging.getLogger("websockets.client").error("keepalive ping failed for %s", SECRET, exc_info=True)
    [record] = handled
    logged = text(record)
    assert logged.startswith("keepalive ping failed for %s (details withheld")
    assert SECRET not in logged and "ValueError: (withheld" in logged and "Traceback" in logged


def test_an_exception_through_the_addons_code_keeps_its_frames_never_its_message(handled):
    try:
        try:
            raise_ours()
        except KeyError as e:
            raise RuntimeError(f"while reading {SECRET}") from e
    except RuntimeError as e:
        logging.getLogger("mitmproxy.addonmanager").error(f"Addon error: {e}", exc_info=True)
    [record] = handled
    logged = text(record)
    assert SECRET not in logged
    assert logged.startswith("Addon error: RuntimeError\nTraceback (most recent call last):")
    assert "KeyError: (withheld" in logged and "direct cause" in logged and "RuntimeError: (withheld" in logged
    assert "somewhere.py" in logged and "lookup" in logged  # where it broke


def test_anything_else_is_left_as_it_was(handled):
    logging.getLogger("stateful_responses.forward.addon").info("stateful-responses: %s", "continued")
    try:
        int("not ours")
    except ValueError:
        logging.getLogger("mitmproxy.proxy.server").error("their own error", exc_info=True)
    assert [text(r).splitlines()[0] for r in handled] == ["stateful-responses: continued", "their own error"]
    assert "invalid literal for int() with base 10: 'not ours'" in text(handled[1])


def test_loading_again_wraps_the_factory_once(handled):
    made = getattr(logging.getLogRecordFactory(), logs._WRAPPED)
    logs.quiet_libraries()
    logs.quiet_libraries()
    assert getattr(logging.getLogRecordFactory(), logs._WRAPPED) is made



def test_a_bad_options_message_the_addon_wrote_is_kept_whole(handled):
    """The Options addon's own refusal, raised in its configure, reaches the log naming the option."""
    from mitmproxy import exceptions
    from mitmproxy.test import taddons
    from stateful_responses.options import Options
    from stateful_responses.settings import Config

    options = Options(Config())
    with taddons.context(options) as tctx:
        try:
            tctx.configure(options, stateful_emulate="sometimes")
        except exceptions.OptionsError:
            logging.getLogger("mitmproxy.addonmanager").exception("error in script")
    assert "stateful_emulate: expected one of off, auto, always, got 'sometimes'" in text(handled[-1])
