"""DVC shows a headline: `dvc metrics show` reads reports/eval/headline.json alone (eleven short keys: one row
within 120 columns; the wider figures.json on demand), the former metric files stay outputs at their paths, the
`dvc exp show` filter docs/results.md gives fits 120 columns, and every plot names its x, y and labels."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipeline.tracking.headline import (
    HEADLINE_KEYS,
    MAX_FIGURES_VALUES,
    best_other,
    check_headline,
    figures,
    headline,
    last_step_reward,
)

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
def test_headline_and_figures_of_every_recorded_evaluation(metrics_file):
    summary = json.loads(metrics_file.read_text())
    steps = metrics_file.with_name(metrics_file.name.replace("_eval_metrics.json", "_train_steps.csv"))
    values = figures(summary, last_step_reward(steps))
    assert len(values) <= MAX_FIGURES_VALUES
    assert not [k for k in values if "/" in k or "." in k]
    assert values["prompt_r1_id_f1"] == summary["averages"]["prompt_r1"]["id"]["f1"]["mean"]
    if "vs_env_only" in summary.get("deltas", {}):
        assert values["delta_vs_env_only_id_f1_low"] == summary["deltas"]["vs_env_only"]["id"]["f1"]["low"]
    if steps.is_file():
        assert values["reward_last_step_mean"] == pytest.approx(pd.read_csv(steps)["critic/score/mean"].iloc[-1])
    short = headline(summary)
    assert set(short) <= set(HEADLINE_KEYS) and len(HEADLINE_KEYS) <= 6
    assert short["f1_id"] == round(summary["averages"]["prompt_r1"]["id"]["f1"]["mean"], 1)


def test_headline_is_prompt_r1_against_the_best_other_system_with_the_ci_and_the_cost():
    """Worked by hand from the recorded default-profile run: env_only has the best ID F1 (5.64) and OOD F1
    (5.02); prompt_r1 − env_only ID −4.55 [−7.66, −2.01], OOD −2.59 [−4.99, −0.17]; 453 tokens per question.
    The CI bounds stay in metrics.json (`deltas`), with the system the gain is measured against."""
    summary = json.loads((RESULTS / "pipeline_avx512_final_eval_metrics.json").read_text())
    assert headline(summary) == {"f1_id": 1.1, "f1_gain_id": -4.5, "f1_ood": 2.4, "f1_gain_ood": -2.6,
                                 "env_tokens": round(summary["cost"]["inference"]["prompt_r1"]["env_tokens_per_question"])}
    assert best_other(summary, "id") == best_other(summary, "ood") == "env_only"
    assert summary["deltas"]["vs_env_only"]["id"]["f1"]["low"] == pytest.approx(-7.66, abs=0.01)


def test_headline_refuses_too_many_values_and_path_like_keys():
    with pytest.raises(ValueError, match=r"6 values, more than 5"):
        check_headline({f"k{i}": 1.0 for i in range(6)})
    with pytest.raises(ValueError, match=r"'leaked_by_eval_file\.hotpot\.parquet' looks like a path"):
        check_headline({"leaked_by_eval_file.hotpot.parquet": 1.0})
    with pytest.raises(ValueError, match=r"'prompt_r1/id/f1' looks like a path"):
        check_headline({"prompt_r1/id/f1": 1.0})


DVC_ENV = {"DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin", "COLUMNS": "120"}


def _dvc(*args: str, cwd: Path) -> str:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**DVC_ENV, "HOME": str(cwd)}).stdout


def test_real_dvc_metrics_show_prints_one_row_within_120_columns(tmp_path):
    """A git + DVC repo holding this dvc.yaml and every file the stages would write as JSON."""
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "tests" / "fixtures" / "stage_outputs" / "reports", tmp_path / "reports")
    recorded = RESULTS / "pipeline_avx512_final_eval_metrics.json"
    summary = json.loads(recorded.read_text())
    shutil.copy(recorded, tmp_path / "reports" / "eval" / "metrics.json")  # the full one: ~1,900 values
    values = headline(summary)
    wide = figures(summary, last_step_reward(RESULTS / "pipeline_avx512_final_train_steps.csv"))
    (tmp_path / "reports" / "eval" / "headline.json").write_text(json.dumps(values))
    (tmp_path / "reports" / "eval" / "figures.json").write_text(json.dumps(wide))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True, env={**DVC_ENV, "HOME": str(tmp_path)})
    _dvc("init", "-q", cwd=tmp_path)

    shown = _dvc("metrics", "show", "--json", cwd=tmp_path)
    files = {path: entry["data"] for rev in json.loads(shown).values() for path, entry in rev["data"].items()}
    assert list(files) == ["reports/eval/headline.json"]
    assert files["reports/eval/headline.json"] == json.loads(json.dumps(values))
    table = _dvc("metrics", "show", cwd=tmp_path)
    rows = [line for line in table.splitlines() if line.strip()]
    assert len(rows) == 2 and rows[1].startswith("reports/eval/headline.json")
    assert max(len(line) for line in rows) <= 120, table
    assert len(rows[0].split()) == 1 + len(HEADLINE_KEYS)
    # the wider figures, on demand
    wider = _dvc("metrics", "show", "reports/eval/figures.json", "--json", cwd=tmp_path)
    (entry,) = [e for rev in json.loads(wider).values() for e in rev["data"].values()]
    assert entry["data"] == json.loads(json.dumps(wide))
    print(table)


def _documented_exp_show() -> list[str]:
    """The `dvc exp show` column filter docs/results.md gives (the one command line with `--keep`)."""
    text = (ROOT / "docs" / "results.md").read_text()
    (command,) = [c for c in re.findall(r"`(dvc exp show [^`]*)`", text) if "--keep" in c]
    return shlex.split(command)


def test_the_documented_dvc_exp_show_filter_fits_120_columns(tmp_path):
    """Run as written in a git + DVC repo with the headline metric and an experiment named as the flow names
    them (`retrain-<UTC stamp>-<flow run>`): every line within 120 columns, no column cut to "…"."""
    command = _documented_exp_show()
    assert command[:3] == ["dvc", "exp", "show"]
    (tmp_path / "reports" / "eval").mkdir(parents=True)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "dvc.yaml").write_text("params:\n  - params.yaml\nmetrics:\n  - reports/eval/headline.json\n")
    summary = json.loads((RESULTS / "pipeline_avx512_final_eval_metrics.json").read_text())
    (tmp_path / "reports" / "eval" / "headline.json").write_text(json.dumps(headline(summary)))
    env = {**DVC_ENV, "HOME": str(tmp_path)}
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True, env=env)
    _dvc("init", "-q", cwd=tmp_path)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "base"], cwd=tmp_path, check=True, env=env)
    summary["averages"]["prompt_r1"]["id"]["f1"]["mean"] = 42.42
    (tmp_path / "reports" / "eval" / "headline.json").write_text(json.dumps(headline(summary)))
    _dvc("exp", "save", "-n", "retrain-20261128-052700-courageous-mongoose", cwd=tmp_path)
    table = _dvc(*command[1:], cwd=tmp_path)
    lines = table.splitlines()
    assert "retrain-20261128-052700-courageous-mongoose" in table and "42.4" in table, table
    assert max(len(line) for line in lines) <= 120 and "…" not in table, table
    header = next(line for line in lines if "Experiment" in line).split()
    assert header[0] == "Experiment" and set(HEADLINE_KEYS) <= set(header), header
    print(table)
