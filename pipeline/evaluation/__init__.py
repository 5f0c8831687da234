"""The evaluate stage's parts, one module per job; `pipeline.evaluate` is the stage that calls them in order.

- `systems`: run each compared system (the trained agent with the environment and the baselines) over the
  evaluation rows, through one harness, into `Answer`s.
- `scores`: score every answer in both metrics modes and aggregate: per-dataset metrics, ID/OOD averages,
  bootstrap CIs, paired deltas (the content of metrics.json).
- `report`: turn that content into files (metrics.json, predictions, plot data, PNG plots, summary.md)
  and MLflow records.

Imports point one way inside the package: `report` → `scores` → `systems`.
"""
