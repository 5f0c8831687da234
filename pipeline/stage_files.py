"""The names of the files and folders the stages pass to each other: the contract between them, in one place.

A stage writes its outputs under a folder params.yaml's `paths` section sets (`paths.reports_dir`,
`paths.rl_dir`, ...); later stages, each stage's key figure (pipeline.stages.figures) and the Prefect flow's
run report (flows/run_report.py) read them back, and dvc.yaml declares the same names as outs and deps. Each name
here is relative to the folder its docstring gives (`<paths.reports_dir> / VALIDATE_SUMMARY`); where a stage
writes several files into one folder, the folder and the file names are separate constants, as the code joins
them. Files one stage keeps to itself (caches, temporary files, logs) are not here.

Design decisions: a leaf that imports nothing, so any module (a stage, pipeline.stages.figures, flows/) can
use it without widening its import closure beyond this one file; the values are the paths
DVC and earlier runs know, and renaming one is a change to dvc.yaml and to every workspace.
"""

SOURCES_DIR = "data/sources"
"""Relative to the project root: `sources` writes one fingerprint `<dataset>.json` per dataset here;
dvc.yaml makes them deps of `sample`, `validate` and `build`; pipeline.stages.figures counts them."""
SOURCES_EVAL_FILE = "eval.json"
"""In SOURCES_DIR: `sources`' fingerprint of the authors' evaluation files; a dvc.yaml dep of `sample`,
`validate` and `build`; read by pipeline.stages.figures."""

SAMPLE_REPORTS_DIR = "sample"
"""In `paths.reports_dir`: `sample` writes `<dataset>.json` (rows written, leaked, skipped) here; `validate`
and pipeline.stages.figures read them."""
VALIDATE_REPORTS_DIR = "validate"
"""In `paths.reports_dir`: `validate` writes SUMMARY_FILE and its data docs here; `build` reads the summary
(it refuses to run on a failed one), and so does pipeline.stages.figures."""
BUILD_REPORTS_DIR = "build"
"""In `paths.reports_dir`: `build` writes SUMMARY_FILE (row counts) here; pipeline.stages.figures reads it."""
SUMMARY_FILE = "summary.json"
"""In VALIDATE_REPORTS_DIR and BUILD_REPORTS_DIR: the stage's summary."""

TRAIN_FILE = "train.parquet"
"""In `paths.rl_dir`: the RL training set `build` writes; `gepa` (its slices), `train`, `merge` (its md5 on
the model card) and `doctor` read it."""
EVAL_SETS_DIR = "eval"
"""In `paths.rl_dir`: `build` writes one `<dataset>.parquet` per evaluation set here; `evaluate` reads them,
and so do `train`'s knowledgeable environment and `doctor`."""

GEPA_PROMPT_FILE = "prompt.json"
"""In `paths.gepa_dir`: the instruction `gepa` optimised and what it cost; `evaluate` reads it (the `gepa`
system's instruction and one-off cost, the verdict's kept-seed note)."""
GEPA_REPORTS_DIR = "gepa"
"""In `paths.reports_dir`: `gepa` writes METRICS_FILE and `history.csv` (a DVC plot) here;
pipeline.stages.figures reads the metrics."""

STEPS_CSV = "train/steps.csv"
"""In `paths.reports_dir`: one row per GRPO step, written by `train` (either backend); `merge` (the model
card's final metrics), `evaluate` (GRPO's one-off cost, the last step's reward) and pipeline.stages.figures read
it; dvc.yaml plots it."""
TRAJECTORIES_FILE = "trajectories.jsonl"
"""Beside STEPS_CSV: what the agent wrote each step (`train`'s local backend); logged to the train run,
kept as a DVC out for people to read."""
RUN_FILE = "mlflow_run.json"
"""In `paths.reports_dir`: the MLflow parent run `train` starts; `gepa`, `evaluate` and `register` attach
their runs to it, flows/run_report.py links it."""

MERGE_REPORT_FILE = "merge_report.json"
"""In `paths.model_dir`: `merge`'s record of the merged model (step, source, logit check); read by
pipeline.stages.figures."""

EVAL_REPORTS_DIR = "eval"
"""In `paths.reports_dir`: `evaluate` writes METRICS_FILE, HEADLINE_FILE, FIGURES_FILE, EVAL_SUMMARY_FILE,
the predictions and the plot data here."""
METRICS_FILE = "metrics.json"
"""In GEPA_REPORTS_DIR and EVAL_REPORTS_DIR: every figure of the stage; `register` reads evaluate's (the
promotion rule), pipeline.stages.figures both."""
HEADLINE_FILE = "headline.json"
"""In EVAL_REPORTS_DIR: the few figures two runs are compared on (pipeline.tracking.headline), dvc.yaml's one
metric."""
FIGURES_FILE = "figures.json"
"""In EVAL_REPORTS_DIR: the wider set of figures, `dvc metrics show reports/eval/figures.json` on demand."""
EVAL_SUMMARY_FILE = "summary.md"
"""In EVAL_REPORTS_DIR: the evaluation's readable report; flows/run_report.py shows it in the run report."""

PROMOTION_FILE = "promotion.json"
"""In `paths.reports_dir`: `register`'s decision (promoted or not, and why); pipeline.stages.figures and
flows/run_report.py read it."""
