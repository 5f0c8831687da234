"""`dvc plots show` works offline and reads well: real DVC on this dvc.yaml, its templates and the recorded outputs.

The page DVC writes loads no script from the network (the repository's HTML template inlines Vega, Vega-Lite and
Vega-Embed; DVC's default loads them from a CDN, so offline every chart was an empty box); the per-dataset F1 is
a panel per split with a bar per system; GEPA's best val score has a 0-1 axis; only the pipeline's own plots are
listed. A headless browser check of the same page is benchmarks/check_plots_offline.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from plots_project import plots_project, show_plots

ROOT = Path(__file__).resolve().parents[1]
NETWORK_SCRIPT = re.compile(r"<script\b[^>]*\bsrc\s*=\s*[\"']?\s*(https?:)?//", re.IGNORECASE)
NETWORK_STYLE = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?\s*(https?:)?//", re.IGNORECASE)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    return show_plots(plots_project(tmp_path_factory.mktemp("plots"))).read_text(encoding="utf-8")


def _specs(page: str) -> dict[str, dict]:
    """Each chart's Vega-Lite spec by its div id, as DVC embedded it (`var spec = {...}; vegaEmbed('#id', spec)`)."""
    found = re.findall(
        r'<div id = "([^"]+)">\s*<script type = "text/javascript">\s*var spec = (.*?);\s*vegaEmbed',
        page,
        re.DOTALL,
    )
    return {div: json.loads(spec) for div, spec in found}


def test_the_page_dvc_writes_loads_no_script_from_the_network(page):
    assert not NETWORK_SCRIPT.search(page), NETWORK_SCRIPT.search(page).group(0)
    assert not NETWORK_STYLE.search(page)
    for package, version in (("vega", "5.20.2"), ("vega-lite", "5.2.0"), ("vega-embed", "6.18.2")):
        assert f"<!-- {package} {version} (npm" in page, package  # inlined, the versions DVC 3.67 loads
    assert page.count("vegaEmbed('#") == len(_specs(page)) >= 6


def test_the_template_keeps_the_charts_placeholder_and_leaves_out_the_scripts_one():
    config = (ROOT / ".dvc" / "config").read_text()
    (template,) = re.findall(r"html_template\s*=\s*(\S+)", config)
    page = (ROOT / ".dvc" / template).read_text(encoding="utf-8")  # DVC reads it relative to .dvc/
    assert "{plot_divs}" in page and "{scripts}" not in page
    for package in ("vega", "vega-lite", "vega-embed"):  # the packages' BSD-3-Clause licences, kept beside it
        licence = (ROOT / ".dvc" / "offline" / f"LICENSE.{package}").read_text()
        assert (
            "University of Washington Interactive Data Lab" in licence and "Redistribution and use" in licence
        )


def test_per_dataset_f1_is_a_panel_per_split_with_a_bar_per_system(page):
    spec = _specs(page)["reports_eval_plot_data_csv"]
    assert spec["facet"]["row"]["field"] == "split"
    encoding = spec["spec"]["encoding"]
    assert encoding["y"]["field"] == "dataset" and encoding["yOffset"]["field"] == "system"
    assert encoding["color"]["field"] == "system" and encoding["x"]["scale"]["domain"] == [0, 100]
    values = spec["data"]["values"]
    per_split = {s: {v["dataset"] for v in values if v["split"] == s} for s in ("ID", "OOD")}
    assert (len(per_split["ID"]), len(per_split["OOD"])) == (8, 4)
    assert spec["spec"]["height"]["step"] == 12  # with yOffset the step is one bar: 12 px, 60 per dataset


def test_gepas_best_val_score_has_a_readable_0_to_1_axis(page):
    spec = _specs(page)["reports_gepa_history_csv"]
    y = spec["encoding"]["y"]
    assert y["field"] == "best_val_score" and y["scale"]["domain"] == [0, 1] and y["axis"]["format"] == ".2f"
    assert {round(float(v["best_val_score"]), 2) for v in spec["data"]["values"]} == {0.17}  # flat: one value


def test_only_the_pipelines_own_plots_are_listed(page):
    assert "learning_steps" not in page and "Learning experiment" not in page


def test_dvc_plots_output_is_ignored_by_git():
    ignored = subprocess.run(["git", "check-ignore", "-q", "dvc_plots/index.html"], check=False, cwd=ROOT)
    assert ignored.returncode == 0
