"""The layout's rules, pinned: every capability's pure core (every module but
its ``addon.py``) and the shared pure modules import no mitmproxy, so tests and
benchmarks drive them alone; no capability imports another capability's glue;
the continuation engine is pure, has no glue, and no transport of it is a
dependency of it (its transports depend on it, never the reverse); the emulator
never imports the addon."""

import ast
import re
import subprocess
import sys

from harness import ROOT

PACKAGE = ROOT / "addon" / "stateful_responses"
CAPABILITIES = ("forward", "store_emulation", "record", "router", "state", "websocket", "request_encoding",
                "compaction", "telemetry", "client_websocket")
# The one continuation engine (planner and prefix store) and its transports: HTTP (forward mode) and the
# upstream's WebSocket mode. A new transport is a capability beside them, with no planner of its own.
ENGINE = "continuation"
TRANSPORTS = ("forward", "websocket")
# Transports that carry each turn through mitmproxy's pipeline as an HTTP request, where forward mode plans it
# with the engine and the emulations expand it: the served WebSocket mode. They neither plan nor expand.
PIPELINE_TRANSPORTS = ("client_websocket",)
# Shared modules that are mitmproxy glue by nature; every other shared module is pure.
SHARED_GLUE = {"flows", "replays", "proofs", "view", "options", "heap", "pipeline", "mitmproxy_script", "cli"}


def module_name(path) -> str:
    return ".".join(("stateful_responses", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def pure_modules() -> list[str]:
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] == "emulator":
            continue
        if len(parts) == 1 and path.stem in SHARED_GLUE or path.name == "addon.py":
            continue
        modules.append(module_name(path))
    return modules


def test_every_capability_has_its_package_with_its_glue_in_addon_py():
    for capability in CAPABILITIES:
        assert (PACKAGE / capability / "addon.py").is_file(), capability


def test_the_pure_modules_import_without_mitmproxy():
    modules = pure_modules()
    assert len(modules) > 20  # the rule is not vacuous
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'addon')!r}); "
            + "; ".join(f"import {m}" for m in modules)
            + "; loaded = [m for m in sys.modules if m.split('.')[0] == 'mitmproxy']; print(loaded); assert not loaded")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def imported_modules(path) -> set[str]:
    """Absolute names of the stateful_responses modules a file imports."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("stateful_responses")}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_capability_imports_another_capabilitys_glue():
    for capability in CAPABILITIES:
        foreign_glue = [f"stateful_responses.{other}.addon" for other in CAPABILITIES if other != capability]
        for path in (PACKAGE / capability).rglob("*.py"):
            assert not [m for m in imported_modules(path) for glue in foreign_glue if within(m, glue)], path


def test_the_engine_is_pure_and_imports_no_capability_but_the_state_layers_pure_parts():
    engine = PACKAGE / ENGINE
    assert not (engine / "addon.py").exists()
    assert {module_name(path) for path in engine.rglob("*.py")} <= set(pure_modules())
    capabilities = [f"stateful_responses.{c}" for c in CAPABILITIES if c != "state"]
    capabilities.append("stateful_responses.state.addon")
    for path in engine.rglob("*.py"):
        assert not [m for m in imported_modules(path) for c in capabilities if within(m, c)], path


def test_every_transport_plans_with_the_engine_and_keeps_no_planner_of_its_own():
    for transport in TRANSPORTS:
        imported = set().union(*(imported_modules(path) for path in (PACKAGE / transport).rglob("*.py")))
        assert f"stateful_responses.{ENGINE}.planner" in imported, transport
        assert not [path for name in ("planner.py", "prefixes.py") for path in (PACKAGE / transport).rglob(name)]


def test_a_pipeline_transport_leaves_planning_to_the_engine_and_expanding_to_the_emulations():
    """No planner, no prefix store, no chain walk of its own: it imports neither the engine nor store emulation
    (forward mode plans its HTTP requests, store emulation and conversations expand them)."""
    for transport in PIPELINE_TRANSPORTS:
        imported = set().union(*(imported_modules(path) for path in (PACKAGE / transport).rglob("*.py")))
        assert imported, transport  # the rule is not vacuous
        for foreign in (ENGINE, "store_emulation", "forward"):
            assert not [m for m in imported if within(m, f"stateful_responses.{foreign}")], (transport, foreign)
        assert not [path for name in ("planner.py", "prefixes.py", "walk.py", "history.py")
                    for path in (PACKAGE / transport).rglob(name)]


def test_no_shared_module_imports_a_capability_but_the_state_layers_pure_parts():
    """The state layer is what every capability stands on: shared modules may
    use its interface (the storage spec, the outbox, access), never its glue."""
    capabilities = [f"stateful_responses.{c}" for c in CAPABILITIES if c != "state"] + ["stateful_responses.state.addon"]
    for path in PACKAGE.glob("*.py"):
        if path.stem in ("pipeline", "mitmproxy_script"):
            continue
        assert not [m for m in imported_modules(path) for c in capabilities if within(m, c)], path


def test_the_emulator_never_imports_the_addon():
    """Neither when it loads nor inside a function (read off every file's imports)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'addon')!r}); import stateful_responses.emulator; "
            "assert not [m for m in sys.modules if m.startswith('stateful_responses.')\n"
            "            and not m.startswith('stateful_responses.emulator')]")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    for path in (PACKAGE / "emulator").rglob("*.py"):
        assert all(within(m, "stateful_responses.emulator") for m in imported_modules(path)), path


def test_every_module_the_addon_imports_is_the_standard_librarys_or_a_declared_dependencys():
    """Nothing relies on what mitmproxy or a test extra happens to bring (mitmproxy 12.3 stopped bringing
    zstandard): each third-party module comes from a dependency pyproject.toml declares, or from one of its
    optional extras other than the tests' (imported only when that feature is on)."""
    import tomllib
    from importlib import metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    declared += [d for extra, deps in project.get("optional-dependencies", {}).items() if extra != "test" for d in deps]
    names = {re.split(r"[<>=!~;\[ ]", d)[0].lower().replace("_", "-") for d in declared}
    providers = metadata.packages_distributions()
    undeclared = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in sys.stdlib_module_names or top == "stateful_responses":
                    continue
                distributions = {d.lower().replace("_", "-") for d in providers.get(top, [])}
                if not distributions & names:
                    undeclared.setdefault(top, set()).add(str(path.relative_to(PACKAGE)))
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
