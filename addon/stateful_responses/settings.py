"""The addon's settings, parsed and validated without mitmproxy.

mitmproxy silently skips a script when a ``--set`` value it cannot parse
targets one of the script's options (verified on mitmproxy 11 and 12), so every value is parsed here
first, by rules that accept what a person would type, and a bad one becomes an
error that names the option.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .state.storage import parse_store_spec

PREFIX = "stateful_"
_TRUE = {"true", "1", "yes", "on", ""}
_FALSE = {"false", "0", "no", "off"}


class SettingsError(ValueError):
    pass


def parse_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise SettingsError(f"{name}: expected true or false, got {value!r}")


def parse_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise SettingsError(f"{name}: expected a positive integer, got {value!r}")
    try:
        number = int(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SettingsError(f"{name}: expected a positive integer, got {value!r}") from None
    if number < 1:
        raise SettingsError(f"{name}: must be at least 1, got {number}")
    return number


def parse_list(name: str, value: object) -> tuple[str, ...]:
    """A list option: repeated ``--set`` values, each may hold commas."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
        raise SettingsError(f"{name}: expected a list of strings, got {value!r}")
    return tuple(p.strip() for v in value for p in v.split(",") if p.strip())


def _check_urls(name: str, urls: tuple[str, ...]) -> tuple[str, ...]:
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise SettingsError(f"{name}: {url!r} is not an http(s) URL prefix")
    return urls


def _check_models(name: str, models: tuple[str, ...]) -> tuple[str, ...]:
    for model in models:
        if "*" in model[:-1]:
            raise SettingsError(f"{name}: {model!r}: '*' is only allowed at the end")
    return models


def parse_text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise SettingsError(f"{name}: expected text, got {value!r}")
    return value.strip()


EMULATE_MODES = ("off", "auto", "always")


def parse_emulate(name: str, value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in EMULATE_MODES:
        return value.strip().lower()
    raise SettingsError(f"{name}: expected one of {', '.join(EMULATE_MODES)}, got {value!r}")


OFF_AUTO = ("off", "auto")  # the capabilities that are on where the upstream lacks what they provide


def parse_off_auto(name: str, value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in OFF_AUTO:
        return value.strip().lower()
    raise SettingsError(f"{name}: expected one of {', '.join(OFF_AUTO)}, got {value!r}")


def parse_listen(name: str, value: object) -> str:
    """``off``, or ``HOST:PORT`` to listen on (an IPv6 host in brackets)."""
    text = value.strip() if isinstance(value, str) else None
    if text is None or text.lower() in ("off", ""):
        if text is None:
            raise SettingsError(f"{name}: expected off or HOST:PORT, got {value!r}")
        return "off"
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingsError(f"{name}: expected off or HOST:PORT (a port from 1 to 65535), got {value!r}")
    return text


TRACES_MODES = ("off", "otlp")


def parse_traces(name: str, value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in TRACES_MODES:
        return value.strip().lower()
    raise SettingsError(f"{name}: expected one of {', '.join(TRACES_MODES)}, got {value!r}")


def listen_address(value: str) -> tuple[str, int]:
    """The host and port of a ``parse_listen`` value other than ``off``."""
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)



def parse_store(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise SettingsError(f"{name}: expected sqlite, sqlite:PATH, memory, redis://… or rediss://…")
    try:
        parse_store_spec(value)
    except ValueError as e:
        raise SettingsError(f"{name}: {e}") from None
    return value.strip()


# name: (parser, mitmproxy type, default, help). Values are parsed here, never
# by mitmproxy (see the module docstring); lists are declared as lists.
OPTIONS: dict[str, tuple[Any, Any, Any, str]] = {
    "stateful_enabled": (parse_bool, bool, True, "Off: the addon touches nothing."),
    "stateful_force_store": (
        parse_bool, bool, True,
        "Send store: true on requests the addon manages, so that a chain can start. "
        "The upstream then retains conversations it would otherwise not.",
    ),
    "stateful_base_urls": (
        lambda n, v: _check_urls(n, parse_list(n, v)), Sequence[str], [],
        "Only flows whose upstream URL starts with one of these prefixes (empty: all).",
    ),
    "stateful_models": (
        lambda n, v: _check_models(n, parse_list(n, v)), Sequence[str], [],
        "Only these models; a trailing * is a wildcard (empty: all).",
    ),
    "stateful_max_chains": (parse_positive_int, int, 256, "How many conversation branches are kept in memory."),
    "stateful_upstreams": (
        lambda n, v: _check_urls(n, parse_list(n, v)), Sequence[str], [],
        "Base URLs of several upstreams to route between (empty: the one upstream of the proxy mode).",
    ),
    "stateful_store": (
        parse_store, str, "sqlite",
        "Where state lives: sqlite (a file in the confdir), sqlite:PATH, memory, "
        "or redis://[:password@]host:port/db / rediss://… shared by several proxies.",
    ),
    "stateful_ttl_days": (parse_positive_int, int, 30, "Days before anything remembered expires."),
    "stateful_emulate": (
        parse_emulate, str, "off",
        "Store emulation for clients that send previous_response_id: off, auto (expand the chain when the "
        "upstream cannot continue it), always (the proxy is the store). Keeps conversation content in the store.",
    ),
    "stateful_max_depth": (parse_positive_int, int, 1000, "Deepest previous_response_id chain expanded."),
    "stateful_conversations_per_credential": (
        parse_positive_int, int, 10_000,
        "Conversations store emulation keeps at once for one credential (their records: a tenth of the store's).",
    ),
    "stateful_record_file": (
        parse_text, str, "",
        "Append one JSON line per LLM API call (its continuation record and mapping audit) to this file.",
    ),
    "stateful_store_max_mb": (parse_positive_int, int, 512, "Size cap of the SQLite file, in MiB."),
    "stateful_store_scale": (
        parse_positive_int, int, 1,
        "Multiplies the records every table of the store keeps at most (1 M turns, 4 M items, ...), for a store "
        "with room for more; every replica on one store sets it alike.",
    ),
    "stateful_seal_key_file": (
        parse_text, str, "",
        "A file holding a key (16 bytes or more) that is mixed into every seal of store emulation's records, "
        "so that a copy of the store alone opens nothing (default: the STATEFUL_RESPONSES_SEAL_KEY variable).",
    ),
    "stateful_upstream_websocket": (
        parse_off_auto, str, "auto",
        "Full-history Responses requests continued over a WebSocket the proxy holds to the upstream (its "
        "WebSocket mode: no storage, the client's store kept): off, or auto (where the upstream accepts the "
        "upgrade; a refusal is remembered per upstream + credential and HTTP is used as before).",
    ),
    "stateful_upstream_websocket_max_sockets": (
        parse_positive_int, int, 32, "Upstream WebSockets held at most per upstream + credential.",
    ),
    "stateful_upstream_websocket_idle_s": (
        parse_positive_int, int, 300, "Seconds an upstream WebSocket may stay unused before it is closed.",
    ),
    "stateful_upstream_websocket_first_event_s": (
        parse_positive_int, int, 60,
        "Seconds a turn on an upstream WebSocket waits for its first event; then the socket is dropped and the "
        "turn goes over HTTP.",
    ),
    "stateful_upstream_websocket_silence_s": (
        parse_positive_int, int, 300,
        "Seconds a turn on an upstream WebSocket waits for each next event; then the socket is dropped: the turn "
        "goes over HTTP if the client has no byte of it yet, else its stream breaks, as a dropped HTTP stream.",
    ),
    "stateful_compaction": (
        parse_off_auto, str, "auto",
        "Compaction (/responses/compact, Codex's compaction_trigger, compaction items) where the upstream lacks "
        "it: auto (the proxy compacts with the upstream's own model, its items sealed per tenant), or off "
        "(passed as sent). Compacted histories are handled exactly either way.",
    ),
    "stateful_metrics": (
        parse_listen, str, "off",
        "Serve Prometheus metrics at http://HOST:PORT/metrics (off: none). Counts, never a credential or a prompt.",
    ),
    "stateful_traces": (
        parse_traces, str, "off",
        "otlp: one OpenTelemetry span per LLM API call, exported over OTLP as the OTEL_EXPORTER_OTLP_* variables "
        "say (needs the otel extra: pip install 'stateful-responses[otel]').",
    ),
    "stateful_client_websocket": (
        parse_off_auto, str, "auto",
        "Serve the Responses API's WebSocket mode to clients (openai SDK connect(), openai-agents, Codex) of an "
        "upstream without it, each turn sent over HTTP: auto (where the upstream refuses the upgrade; learned per "
        "upstream + credential) or off (upgrades pass through untouched).",
    ),
    "stateful_background": (
        parse_off_auto, str, "auto",
        "Background responses (background: true) where the upstream has no background mode: auto (the proxy "
        "runs, polls, cancels and resumes them; passed through where the upstream has the mode), or off.",
    ),
    "stateful_background_jobs_per_credential": (
        parse_positive_int, int, 64,
        "Background responses the proxy runs at once for one credential, over every replica (beyond: passed through).",
    ),
    "stateful_background_lease_s": (
        parse_positive_int, int, 30,
        "Seconds a background response the proxy runs stays in progress without a sign of life from its "
        "proxy; then it is failed (its proxy died).",
    ),
    "stateful_debug": (parse_bool, bool, False, "Log one line per decision."),
}
PARSERS = {name: spec[0] for name, spec in OPTIONS.items()}
LIST_OPTIONS = frozenset(name for name, spec in OPTIONS.items() if spec[1] is Sequence[str])


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    force_store: bool = True
    base_urls: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    max_chains: int = 256
    upstreams: tuple[str, ...] = ()
    store: str = "sqlite"
    ttl_days: int = 30
    emulate: str = "off"
    max_depth: int = 1000
    conversations_per_credential: int = 10_000
    record_file: str = ""
    store_max_mb: int = 512
    store_scale: int = 1
    seal_key_file: str = ""
    upstream_websocket: str = "auto"
    upstream_websocket_max_sockets: int = 32
    upstream_websocket_idle_s: int = 300
    upstream_websocket_first_event_s: int = 60
    upstream_websocket_silence_s: int = 300
    compaction: str = "auto"
    metrics: str = "off"
    traces: str = "off"
    client_websocket: str = "auto"
    background: str = "auto"
    background_jobs_per_credential: int = 64
    background_lease_s: int = 30
    debug: bool = False

    @classmethod
    def from_options(cls, values: dict[str, object]) -> Settings:
        parsed = {name: PARSERS[name](name, values[name]) for name in PARSERS if name in values}
        return cls(**{name.removeprefix(PREFIX): v for name, v in parsed.items()})

    def record_cap(self, declared: int) -> int:
        """Records a table the code declares ``declared`` for keeps at most:
        scaled by ``store_scale``; ``memory`` keeps a tenth of a large one."""
        scaled = declared * self.store_scale
        return min(scaled, max(scaled // 10, 10_000)) if self.store.strip() == "memory" else scaled

    def url_matches(self, url: str) -> bool:
        return not self.base_urls or any(url.startswith(p) for p in self.base_urls)

    def model_matches(self, model: str) -> bool:
        if not self.models:
            return True
        return any(
            model.startswith(p[:-1]) if p.endswith("*") else model == p for p in self.models
        )


@dataclass
class Config:
    """The settings in force and the clock: one object every addon holds, so
    that a ``--set`` at run time reaches all of them at once."""

    settings: Settings = field(default_factory=Settings)
    clock: Callable[[], float] = field(default=time.time, repr=False)
    _changed: list[Callable[[Settings, Settings], None]] = field(default_factory=list, repr=False)

    def on_change(self, callback: Callable[[Settings, Settings], None]) -> None:
        """Call ``callback(old, new)`` whenever the settings change."""
        self._changed.append(callback)

    def update(self, settings: Settings) -> None:
        old, self.settings = self.settings, settings
        for callback in self._changed:
            callback(old, settings)

    @property
    def ttl(self) -> float:
        """Seconds before anything remembered expires."""
        return self.settings.ttl_days * 86400.0


def unknown_names(names: Iterable[str]) -> list[str]:
    """Names with our prefix that are not our options (likely misspellings)."""
    return sorted(n for n in names if n.startswith(PREFIX) and n not in PARSERS)
