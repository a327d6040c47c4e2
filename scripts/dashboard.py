"""docs/dashboard.png: the Grafana dashboard (docs/grafana-dashboard.json)
drawn from real figures. The emulator, mitmdump with the addon
(stateful_metrics on, store emulation, the bridge) and Debian's prometheus
scraping it run on loopback; a demo's traffic passes for a few minutes
(agents resending their whole history over HTTP and over the bridge, a
client that chains previous_response_id against an upstream that forgets,
now and then a refused continuation); then every panel's own queries are
asked of Prometheus over the run (``$__rate_interval`` as 15s) and drawn
with matplotlib, panel by panel where the JSON places them. Grafana itself
is not needed (Debian has no package of it).

``.venv/bin/python scripts/dashboard.py [--minutes N]``
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "addon"), str(ROOT / "tests")]

from driver import ChainedConversation, Conversation  # noqa: E402
from harness import free_port, start_mitmdump  # noqa: E402
from stateful_responses.emulator import Emulator  # noqa: E402
from telemetry_support import PrometheusServer  # noqa: E402

DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
PICTURE = ROOT / "docs" / "dashboard.png"
STEP_S = 5


def traffic(proxy_url: str, emulator, until: float) -> None:
    """Agents until ``until``: full-history ones (half over HTTP: their
    upgrade refused), one chaining previous_response_id, and a fault now
    and then; each conversation some turns long, then a new one."""
    rng = random.Random(7)

    def agent(n: int, chained: bool) -> None:
        kind = ChainedConversation if chained else Conversation
        while time.time() < until:
            conversation = kind(proxy_url, api_key=f"sk-demo-{n}", model="gpt-demo", stream=n % 2 == 0)
            for turn in range(rng.randint(4, 12)):
                if time.time() >= until:
                    break
                text = f"agent {n} turn {turn}" + (f' call:get_weather({{"city": "C{turn}"}})' if turn % 3 == 1
                                                   else "")
                try:
                    conversation.turn(text)
                except Exception:  # noqa: BLE001 - a fault the demo injected reached this client: a new conversation
                    break
                time.sleep(rng.uniform(0.2, 1.5))
            conversation.close()

    def faults() -> None:
        while time.time() < until:
            time.sleep(rng.uniform(8, 20))
            emulator.model.control({"fail_next": [rng.choice([{"kind": "reject", "when": "continued"},
                                                                {"kind": "ws_close", "after_events": 0}])]})

    emulator.model.control({"websocket": "refuse"})  # the first agents' upgrades are refused: HTTP for them
    threads = [threading.Thread(target=agent, args=(n, False)) for n in range(2)]
    threads[0].start(), threads[1].start()
    time.sleep(3)
    emulator.model.control({"websocket": None})
    threads += [threading.Thread(target=agent, args=(n, False)) for n in range(2, 4)]
    threads += [threading.Thread(target=agent, args=(4, True)), threading.Thread(target=faults)]
    for thread in threads[2:]:
        thread.start()
    for thread in threads:
        thread.join()


def query_range(prometheus: PrometheusServer, expression: str, start: float, end: float) -> list[dict]:
    expression = expression.replace("$__rate_interval", "15s").replace('upstream=~"$upstream"', 'upstream=~".*"')
    url = f"http://127.0.0.1:{prometheus.port}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expression, "start": start, "end": end, "step": STEP_S})
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.load(answer)["data"]["result"]


def legend(template: str, labels: dict) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def draw(panels: list[dict], series: dict[int, list[tuple[str, list, list]]], minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    figure = plt.figure(figsize=(16, rows * 0.42), facecolor="#111217")
    grid = GridSpec(rows, 24, figure=figure, hspace=2.4, wspace=1.2)
    for panel in panels:
        g = panel["gridPos"]
        axes = figure.add_subplot(grid[g["y"]:g["y"] + g["h"], g["x"]:g["x"] + g["w"]])
        axes.set_facecolor("#181b1f")
        axes.set_title(panel["title"], color="#d8d9da", loc="left", fontsize=10)
        axes.tick_params(colors="#8e8e8e", labelsize=7)
        for spine in axes.spines.values():
            spine.set_color("#2c3235")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        scale = {"s": (1000, " ms"), "percentunit": (100, " %")}.get(unit, (1, ""))
        lines = series[panel["id"]]
        if panel["type"] == "stat":
            name, times, values = lines[0] if lines else ("", [], [])
            last = next((v for v in reversed(values) if v == v), float("nan"))
            axes.fill_between(times, [v * scale[0] for v in values], color="#73bf69", alpha=0.25)
            axes.text(0.5, 0.45, f"{last * scale[0]:.1f}{scale[1]}", transform=axes.transAxes, ha="center",
                      va="center", fontsize=30, color="#73bf69", fontweight="bold")
            axes.set_xticks([])
            axes.set_yticks([])
            continue
        for name, times, values in lines:
            style = {"drawstyle": "steps-post"} if "since the proxy started" in panel["title"] else {}
            axes.plot(times, [v * scale[0] for v in values], label=name, linewidth=1.4, **style)
        if lines:
            axes.legend(fontsize=7, facecolor="#181b1f", labelcolor="#d8d9da", edgecolor="#2c3235", loc="upper left")
        axes.set_ylabel(scale[1].strip() or unit, color="#8e8e8e", fontsize=8)
        axes.set_xlabel("minutes", color="#8e8e8e", fontsize=7)
        axes.set_xlim(0, minutes)
        axes.grid(color="#2c3235", linewidth=0.5)
    figure.suptitle("stateful-responses (docs/grafana-dashboard.json), drawn from Prometheus's answers to its "
                    f"queries over a {minutes:.0f}-minute demo run", color="#d8d9da", fontsize=11, x=0.125, ha="left")
    figure.savefig(PICTURE, dpi=90, facecolor=figure.get_facecolor(), bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=4.0)
    args = parser.parse_args()
    panels = json.loads(DASHBOARD.read_text())["panels"]
    work = Path(tempfile.mkdtemp(prefix="stateful-dashboard-"))
    address = f"127.0.0.1:{free_port()}"
    with Emulator() as emulator:
        emulator.model.control({"forget_probability": 0.05})  # an upstream that forgets now and then
        proxy = start_mitmdump(emulator.url, "--set", f"stateful_metrics={address}", "--set",
                               "stateful_emulate=auto", upstream_websocket="auto")
        prometheus = PrometheusServer(work / "prometheus", [address])
        try:
            prometheus.scraped_up()
            start = time.time()
            traffic(proxy.url, emulator, start + args.minutes * 60)
            time.sleep(3)  # the last scrape
            end = time.time()
            series = {}
            for panel in panels:
                series[panel["id"]] = [
                    (legend(target.get("legendFormat", ""), r["metric"]),
                     [(float(t) - start) / 60 for t, _ in r["values"]], [float(v) for _, v in r["values"]])
                    for target in panel["targets"] for r in query_range(prometheus, target["expr"], start, end)]
        finally:
            prometheus.stop()
            proxy.stop()
    draw(panels, series, (end - start) / 60)
    print(f"wrote {PICTURE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
