"""Write DVC's offline HTML template for `dvc plots show`: Vega, Vega-Lite and Vega-Embed inlined, no CDN.

    npm pack vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2      (in a scratch folder)
    python scripts/offline_plots_template.py <that folder>

DVC 3.67's default page loads these three versions from cdn.jsdelivr.net (dvc_render's `VegaRenderer.SCRIPTS`),
so on a node without internet every interactive chart is an empty `<div>`. `.dvc/config` points
`plots.html_template` at the page written here (`.dvc/offline/plots.html`, relative to `.dvc/`). The page keeps
`{plot_divs}` (where DVC puts the charts) and has no `{scripts}` placeholder: DVC would put its CDN `<script>`
tags there. The minified builds are taken unchanged from the npm packages; their licences are copied beside the
page (`.dvc/offline/LICENSE.<package>`).
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

PACKAGES = {
    "vega": ("5.20.2", "build/vega.min.js"),
    "vega-lite": ("5.2.0", "build/vega-lite.min.js"),
    "vega-embed": ("6.18.2", "build/vega-embed.min.js"),
}
"""npm package → (the version DVC 3.67 loads, the file inlined)."""
OUT = Path(__file__).resolve().parents[1] / ".dvc" / "offline"

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    <title>DVC Plot</title>
{scripts_inline}
    <style>
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def _member(pack: Path, name: str) -> str:
    with tarfile.open(pack) as tar:
        data = tar.extractfile(f"package/{name}")
        if data is None:
            raise SystemExit(f"{pack} has no package/{name}")
        return data.read().decode("utf-8")


def write_template(packs: Path, out: Path = OUT) -> Path:
    """The page and the licences, from `<package>-<version>.tgz` files (`npm pack`) in `packs`."""
    out.mkdir(parents=True, exist_ok=True)
    scripts = []
    for package, (version, build) in PACKAGES.items():
        pack = packs / f"{package}-{version}.tgz"
        if not pack.is_file():
            raise SystemExit(f"{pack} is missing: run `npm pack {package}@{version}` in {packs}")
        code = _member(pack, build)
        if "</script" in code.lower() or "{plot_divs}" in code or "{scripts}" in code:
            raise SystemExit(
                f"{package} {version} cannot be inlined as it is (a closing tag or a DVC placeholder)"
            )
        scripts.append(
            f"    <!-- {package} {version} (npm, {build}; licence: LICENSE.{package}) -->\n"
            f"    <script>{code}</script>"
        )
        (out / f"LICENSE.{package}").write_text(_member(pack, "LICENSE"), encoding="utf-8")
    page = out / "plots.html"
    page.write_text(PAGE.format(scripts_inline="\n".join(scripts)), encoding="utf-8")
    return page


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(write_template(Path(sys.argv[1])))
