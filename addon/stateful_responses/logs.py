"""What reaches mitmproxy's log from the libraries the addon brings, and from
exceptions raised through its code: never a credential, never prompt text.

mitmproxy sets the root logger to DEBUG and quiets only libraries of its own
(tornado, asyncio, hpack, aioquic); its terminal prints what
``termlog_verbosity`` lets through, and mitmweb keeps every level in its event
log, served at ``GET /events``. So the libraries the addon brings are set to
WARNING here, once, when the addon loads:

- ``websockets`` (the bridge's upstream sockets): at DEBUG, each handshake's
  request line and headers (the URL's query, ``Authorization``) and the first
  and last bytes of every frame (the client's input, the model's answer).
  The bridge's sockets log to a logger of ours (``SOCKETS``) besides, so that
  enabling ``websockets``' own logging elsewhere cannot reach them.
- ``redis`` (redis-py, the Redis backend) and its ``push_response``: at DEBUG,
  connection and cluster details and the server's push messages.

What passes, at WARNING and above, is stripped as it is made (a log record
factory): a record of those libraries keeps its message's template and its
exception's type, never the values put into it; a record carrying an exception
raised through the addon's code keeps the traceback's frames and the
exception's type, never its message (a decode error or a KeyError can quote a
request), unless the addon wrote the message itself (a bad option's). The addon's own lines name upstreams by scheme and host and
credentials by keyed digest (``tenancy``)."""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

SOCKETS = "stateful_responses.websocket.sockets"  # what websockets says about the bridge's sockets
# opentelemetry (the traces' SDK and exporter) and urllib3 under it: at DEBUG, the collector's URL and headers.
LIBRARIES = ("websockets", "redis", "push_response", "opentelemetry", "urllib3", SOCKETS)
LEVEL = logging.WARNING
WITHHELD = "withheld: it may quote a request or a credential"
_PREFIXES = tuple(name + "." for name in LIBRARIES)
# Exceptions whose message the addon writes itself, naming what is wrong and never a value that may be secret:
# a bad option (the ``stateful_*`` parsers never repeat a store URL that may hold a password).
_OWN_WORDS = frozenset({"mitmproxy.exceptions.OptionsError"})
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_WRAPPED = "_stateful_responses_wraps"  # the factory ours wraps, on ours (a reload wraps that one again)


def quiet_libraries() -> None:
    """Set the libraries' loggers to ``LEVEL`` and strip what passes. Idempotent:
    a reload of the script replaces the factory it installed before."""
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(LEVEL)
    current = logging.getLogRecordFactory()
    made = getattr(current, _WRAPPED, current)

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = made(*args, **kwargs)
        try:
            strip(record)
        except Exception:  # noqa: BLE001 - logging must never raise into the code that logs
            record.msg, record.args, record.exc_info, record.exc_text = f"a line {WITHHELD}", None, None, None
        return record

    setattr(factory, _WRAPPED, made)
    logging.setLogRecordFactory(factory)


def strip(record: logging.LogRecord) -> None:
    """Withhold from ``record`` whatever could carry a request's content: in
    place, before any handler formats it."""
    exc_info = record.exc_info
    exception = exc_info[1] if isinstance(exc_info, tuple) else None
    library = record.name in LIBRARIES or record.name.startswith(_PREFIXES)
    if exception is not None and _name(type(exception)) in _OWN_WORDS:
        return
    if not library and not (exception is not None and _passes_through_ours(exception)):
        return
    message = str(record.msg)
    if library and record.args:
        message += f" (details {WITHHELD})"
    elif record.args:
        message = record.getMessage()
    if exception is not None:
        if not library:
            for text in (_safe_str(exception), _safe_str(exception, repr)):
                if text:
                    message = message.replace(text, type(exception).__name__)
        message += "\n" + _traceback(exception)
    record.msg, record.args = message, None
    record.exc_info, record.exc_text = None, None


def _passes_through_ours(exception: BaseException) -> bool:
    return any(frame.f_code.co_filename.startswith(_PACKAGE)
               for e in _chain(exception) for frame, _ in traceback.walk_tb(e.__traceback__))


def _chain(exception: BaseException) -> list[BaseException]:
    """The exception, then what it was raised from or during, as a traceback prints them."""
    chain: list[BaseException] = []
    e: BaseException | None = exception
    while e is not None and e not in chain and len(chain) < 16:
        chain.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return chain


def _traceback(exception: BaseException) -> str:
    """The traceback as Python prints it, each exception's message withheld."""
    text = ""
    for e in reversed(_chain(exception)):
        if text:
            text += ("\n\nThe above exception was the direct cause of the following exception:\n\n" if e.__cause__
                     else "\n\nDuring handling of the above exception, another exception occurred:\n\n")
        frames = "".join(traceback.format_tb(e.__traceback__))
        text += f"Traceback (most recent call last):\n{frames}{_name(type(e))}: ({WITHHELD})"
    return text


def _name(kind: type) -> str:
    """An exception type's name as a traceback prints it."""
    module = kind.__module__
    return kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"


def _safe_str(exception: BaseException, how=str) -> str:
    try:
        return how(exception)
    except Exception:  # noqa: BLE001 - a broken __str__ must not break logging
        return ""
