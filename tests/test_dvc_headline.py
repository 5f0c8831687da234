"""DVC shows a headline: `dvc metrics show` reads reports/eval/headline.json alone (at most 30 flat values, no
key a path), the former metric files stay outputs at their paths, and every plot names its x, y and labels."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipeline.headline import MAX_HEADLINE_VALUES, check_headline, headline, last_step_reward

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HEADLINE = "${paths.reports_dir}/eval/headline.json"
FORMER_METRICS = ("${paths.reports_dir}/sample/${item}.json", "${paths.reports_dir}/validate/summary.json",
                  "${paths.reports_dir}/build/summary.json", "${paths.reports_dir}/gepa/metrics.json",
                  "${paths.reports_dir}/eval/metrics.json")


def _stages() -> dict[str, dict]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: body.get("do", body) for name, body in stages.items()}


def _entries(body: dict, section: str) -> dict[str, dict]:
    out = {}
    for entry in body.get(section) or []:
        if isinstance(entry, dict):
            (path, options), = entry.items()
            out[path] = options or {}
        else:
            out[entry] = {}
    return out


def test_the_only_dvc_metric_is_the_headline_and_the_former_metrics_stay_outputs():
    metrics = {path: stage for stage, body in _stages().items() for path in _entries(body, "metrics")}
    assert metrics == {HEADLINE: "evaluate"}
    outs = {path: options for body in _stages().values() for path, options in _entries(body, "outs").items()}
    for path in FORMER_METRICS:
        assert path in outs and outs[path].get("cache") is False, path


def test_every_dvc_plot_names_its_x_and_y_and_labels_its_axes():
    for stage, body in _stages().items():
        for path, options in _entries(body, "plots").items():
            if Path(path).suffix == "":  # a folder of PNG images: DVC shows the pictures, no axes to name
                assert stage == "evaluate" and path.endswith("/eval/plots"), path
                continue
            missing = [k for k in ("x", "y", "title", "x_label", "y_label") if not options.get(k)]
            assert not missing, f"dvc.yaml stage {stage}, plot {path}: missing {missing}"
    assert _entries(_stages()["train"], "plots")["${paths.reports_dir}/train/steps.csv"]["x"] == "step"
    for plot in yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]:
        (name, options), = plot.items()
        missing = [k for k in ("x", "y", "x_label", "y_label") if not options.get(k)]
        assert not missing, f"dvc.yaml plot {name!r}: missing {missing}"


def _recorded() -> list[Path]:
    return sorted(RESULTS.glob("pipeline*_eval_metrics.json"))


@pytest.mark.parametrize("metrics_file", _recorded(), ids=lambda p: p.stem)
def test_headline_of_every_recorded_evaluation_fits_one_terminal_row(metrics_file):
    summary = json.loads(metrics_file.read_text())
    steps = metrics_file.with_name(metrics_file.name.replace("_eval_metrics.json", "_train_steps.csv"))
    values = headline(summary, last_step_reward(steps))
    assert len(values) <= MAX_HEADLINE_VALUES
    assert not [k for k in values if "/" in k or "." in k]
    assert values["prompt_r1_id_f1"] == summary["averages"]["prompt_r1"]["id"]["f1"]["mean"]
    if "vs_env_only" in summary.get("deltas", {}):
        assert values["delta_vs_env_only_id_f1_low"] == summary["deltas"]["vs_env_only"]["id"]["f1"]["low"]
    if steps.is_file():
        assert values["reward_last_step_mean"] == pytest.approx(pd.read_csv(steps)["critic/score/mean"].iloc[-1])


def test_headline_refuses_too_many_values_and_path_like_keys():
    with pytest.raises(ValueError, match=r"31 values, more than 30"):
        check_headline({f"k{i}": 1.0 for i in range(31)})
    with pytest.raises(ValueError, match=r"'leaked_by_eval_file\.hotpot\.parquet' looks like a path"):
        check_headline({"leaked_by_eval_file.hotpot.parquet": 1.0})
    with pytest.raises(ValueError, match=r"'prompt_r1/id/f1' looks like a path"):
        check_headline({"prompt_r1/id/f1": 1.0})


def test_real_dvc_metrics_show_prints_one_narrow_row(tmp_path):
    """A git + DVC repo holding this dvc.yaml and every file the stages would write as JSON."""
    env = {"DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin",
           "HOME": str(tmp_path)}
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "tests" / "fixtures" / "stage_outputs" / "reports", tmp_path / "reports")
    recorded = RESULTS / "pipeline_avx512_final_eval_metrics.json"
    shutil.copy(recorded, tmp_path / "reports" / "eval" / "metrics.json")  # the full one: ~1,900 values
    values = headline(json.loads(recorded.read_text()),
                      last_step_reward(RESULTS / "pipeline_avx512_final_train_steps.csv"))
    (tmp_path / "reports" / "eval" / "headline.json").write_text(json.dumps(values))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True, env=env)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True, env=env)

    shown = subprocess.run([sys.executable, "-m", "dvc", "metrics", "show", "--json"], cwd=tmp_path,
                           check=True, capture_output=True, text=True, env=env)
    files = {path: entry["data"] for rev in json.loads(shown.stdout).values()
             for path, entry in rev["data"].items()}
    assert list(files) == ["reports/eval/headline.json"]
    assert files["reports/eval/headline.json"] == json.loads(json.dumps(values))
    table = subprocess.run([sys.executable, "-m", "dvc", "metrics", "show"], cwd=tmp_path, check=True,
                           capture_output=True, text=True, env=env).stdout
    rows = [line.split() for line in table.splitlines() if line.strip()]
    assert len(rows) == 2 and rows[1][0] == "reports/eval/headline.json"
    assert len(rows[0]) == len(rows[1]) <= MAX_HEADLINE_VALUES + 1  # Path + at most 30 values
    print(table)
