"""Open the page `dvc plots show` writes in headless Chromium with the network off, and count the rendered charts.

    python benchmarks/check_plots_offline.py [--html dvc_plots/index.html]

Without `--html` it builds a DVC project from recorded outputs (tests/plots_project.py: this dvc.yaml, its
templates and offline page, the plot files of a default-profile run) and runs `dvc plots show` there. The browser
runs in a network namespace of its own (`unshare --net`: only a loopback that is down, so no request can leave),
with a virtual-time budget for Vega's asynchronous rendering, and prints the DOM; a chart counts as rendered when
its div holds Vega's `marks` canvas or SVG. Prints one JSON line: charts on the page, rendered, images, and the
page's script sources. Needs `chromium` (apt) and `unshare` (util-linux), run as root or with user namespaces.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("no Chromium found: apt-get install chromium")


def rendered_dom(html: Path, budget_ms: int = 20000) -> str:
    """The page's DOM after its scripts ran, from Chromium in a namespace without network."""
    command = [
        "unshare",
        "--net",
        "--",
        browser(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--virtual-time-budget={budget_ms}",
        "--dump-dom",
        html.resolve().as_uri(),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=180)
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def count(page: str, dom: str) -> dict[str, object]:
    """Charts the page defines (vegaEmbed calls), charts drawn in the DOM (a `marks` canvas or svg in the chart's
    div, before the next chart's), images, and the page's script sources (none should be remote)."""
    charts = re.findall(r"vegaEmbed\('#([^']+)'", page)
    starts = sorted((dom.find(f'id="{c}"'), c) for c in charts if f'id="{c}"' in dom)
    drawn = []
    for (start, chart), (end, _) in zip(starts, [*starts[1:], (len(dom), "")]):
        if 'class="marks"' in dom[start:end]:
            drawn.append(chart)
    sources = re.findall(r"<script\b[^>]*\bsrc\s*=\s*[\"']?([^\"' >]+)", page, re.IGNORECASE)
    return {
        "charts": len(charts),
        "rendered": len(drawn),
        "not_rendered": sorted(set(charts) - set(drawn)),
        "images": len(re.findall(r"<img\b", dom)),
        "script_sources": sources,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", type=Path, help="a page `dvc plots show` wrote (default: build one)")
    args = parser.parse_args()
    if args.html is None:
        from plots_project import plots_project, show_plots

        html = show_plots(plots_project(Path(tempfile.mkdtemp(prefix="plots-offline-"))))
    else:
        html = args.html
    page = html.read_text(encoding="utf-8")
    print(json.dumps({"page": str(html), **count(page, rendered_dom(html))}))


if __name__ == "__main__":
    main()
