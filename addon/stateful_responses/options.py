"""Every stateful_* option, registered once and parsed by our own rules.

mitmproxy parses deferred ``--set`` values when a script registers its options
and, on a value it cannot parse, silently skips the whole script; misspelled
names are ignored. This addon runs first: it parses every deferred value of
ours, registers the options, and makes mitmdump exit naming the option when a
value is bad or a ``stateful_*`` name unknown. The parsed ``Settings`` go to
the ``Config`` every other addon of ours holds.
"""

from __future__ import annotations

from mitmproxy import ctx, exceptions

from .settings import LIST_OPTIONS, OPTIONS, PARSERS, Config, Settings, SettingsError, unknown_names


class Options:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._errors: list[str] = []

    def load(self, loader) -> None:
        self._errors = self._prevalidate(loader.master.options)
        for name, (_, kind, default, help_text) in OPTIONS.items():
            loader.add_option(name, kind, default, help_text)

    @staticmethod
    def _prevalidate(options) -> list[str]:
        """Parse our deferred ``--set`` values before mitmproxy does.

        mitmproxy parses deferred values when the script registers its options
        and, on a value it cannot parse, silently skips the whole script. We
        parse them first with our own rules: good values are handed over
        already converted, bad ones are removed and reported from
        ``configure``, which makes mitmdump exit with the option's name.
        """
        errors = []
        deferred = getattr(options, "deferred", {})
        for name in [n for n in deferred if n in PARSERS]:
            raw = deferred[name]
            value = getattr(raw, "val", raw)  # --set gives a list of strings
            if isinstance(value, list) and name not in LIST_OPTIONS:
                value = value[-1] if value else ""
            try:
                parsed = PARSERS[name](name, value)
                deferred[name] = list(parsed) if isinstance(parsed, tuple) else parsed
            except SettingsError as e:
                errors.append(str(e))
                del deferred[name]
        return errors

    def configure(self, updated: set[str]) -> None:
        if self._errors:
            errors, self._errors = self._errors, []
            raise exceptions.OptionsError("; ".join(errors))
        unknown = unknown_names(getattr(ctx.options, "deferred", {}))
        if unknown:
            raise exceptions.OptionsError(
                f"unknown option(s) {', '.join(unknown)}; "
                f"stateful-responses knows {', '.join(sorted(PARSERS))}"
            )
        if not updated & PARSERS.keys():
            return
        try:
            settings = Settings.from_options({n: getattr(ctx.options, n) for n in PARSERS})
        except SettingsError as e:
            raise exceptions.OptionsError(str(e)) from None
        self.config.update(settings)
