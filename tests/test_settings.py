"""Option parsing and validation (pure)."""

from __future__ import annotations

import pytest
from stateful_responses.settings import Settings, SettingsError, unknown_names


def test_defaults_match_the_documented_table():
    s = Settings.from_options({})
    assert (s.enabled, s.force_store, s.base_urls, s.models, s.max_chains, s.debug) == (True, True, (), (), 256, False)


@pytest.mark.parametrize("text,value", [("true", True), ("YES", True), ("on", True), ("1", True),
                                        ("false", False), ("no", False), ("Off", False), ("0", False)])
def test_booleans_a_person_would_type(text, value):
    assert Settings.from_options({"stateful_debug": text}).debug is value


@pytest.mark.parametrize(
    "options",
    [{"stateful_debug": "maybe"}, {"stateful_max_chains": "0"}, {"stateful_max_chains": "lots"},
     {"stateful_max_chains": True}, {"stateful_base_urls": ["api.openai.com"]}, {"stateful_models": ["g*pt"]}],
)
def test_bad_values_name_the_option(options):
    with pytest.raises(SettingsError, match=next(iter(options))):
        Settings.from_options(options)


def test_lists_and_wildcards():
    s = Settings.from_options({"stateful_models": ["gpt-5*, o4-mini"], "stateful_base_urls": ["https://api.openai.com/v1"]})
    assert s.models == ("gpt-5*", "o4-mini")
    assert s.model_matches("gpt-5.1-codex") and s.model_matches("o4-mini") and not s.model_matches("o4-mini-2")
    assert s.url_matches("https://api.openai.com/v1/responses") and not s.url_matches("http://api.openai.com/v1/responses")


def test_misspelled_names_are_found():
    assert unknown_names(["stateful_debgu", "stateful_debug", "other_option"]) == ["stateful_debgu"]


def test_the_websocket_bridge_is_on_where_the_upstream_accepts_it_by_default():
    s = Settings.from_options({})
    assert (s.upstream_websocket, s.upstream_websocket_max_sockets, s.upstream_websocket_idle_s) == ("auto", 32, 300)
    assert (s.upstream_websocket_first_event_s, s.upstream_websocket_silence_s) == (60, 300)
    assert Settings.from_options({"stateful_upstream_websocket": " OFF "}).upstream_websocket == "off"


@pytest.mark.parametrize("options", [{"stateful_upstream_websocket": "always"},
                                     {"stateful_upstream_websocket_max_sockets": "0"},
                                     {"stateful_upstream_websocket_idle_s": "-5"},
                                     {"stateful_upstream_websocket_first_event_s": "0"},
                                     {"stateful_upstream_websocket_silence_s": "soon"}])
def test_bad_websocket_values_name_the_option(options):
    with pytest.raises(SettingsError, match=next(iter(options))):
        Settings.from_options(options)


def test_the_store_scale_multiplies_the_declared_caps_and_memory_keeps_a_tenth():
    assert Settings.from_options({}).record_cap(1_000_000) == 1_000_000
    assert Settings.from_options({"stateful_store_scale": "3"}).record_cap(1_000_000) == 3_000_000
    memory = Settings.from_options({"stateful_store": "memory", "stateful_store_scale": "3"})
    assert (memory.record_cap(1_000_000), memory.record_cap(20_000)) == (300_000, 10_000)
    with pytest.raises(SettingsError, match="stateful_store_scale"):
        Settings.from_options({"stateful_store_scale": "0"})


def test_readme_lists_every_option_with_its_default():
    """The options table in README names every option once, and the number
    and boolean defaults there are the code's."""
    from pathlib import Path

    from stateful_responses.settings import OPTIONS

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = [line.split("|")[1:-1] for line in readme.splitlines() if line.startswith("| `stateful_")]
    documented = {cells[0].strip().strip("`"): cells[2].strip() for cells in rows}
    assert len(rows) == len(documented) and documented.keys() == OPTIONS.keys()
    for name, (_, kind, default, _) in OPTIONS.items():
        if kind is bool:
            assert documented[name] == f"`{str(default).lower()}`", name
        elif kind is int:
            assert documented[name] == f"`{default}`", name
