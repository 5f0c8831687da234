"""The evaluate stage's parts, one module per job; `pipeline.stages.evaluate` is the stage that calls them in order.

- `systems`: run each compared system (the trained agent with the environment and the baselines) over the
  evaluation rows, through one harness, into `Answer`s.
- `scores`: score every answer in both metrics modes and aggregate: per-dataset metrics, ID/OOD averages,
  bootstrap CIs, paired deltas (the content of metrics.json).
- `costs`: what each system costs per question (environment requests, tokens, USD) and once to make
  (GRPO training, GEPA search); where the gepa stage's optimised prompt lives.
- `paper`: the paper's published numbers (`paper_results.yaml`, data) beside ours, with the difference when
  the run is comparable.
- `traces`: what MLflow shows of the answers: one trace per evaluated trajectory (spans per turn, scores on
  the root) and the predictions table.
- `verdict`: summary.md's opening: which system wins and by how much, why when the setup is not the
  paper's, each metric's definition and its one spelling.
- `report`: turn that content into files (metrics.json, headline.json, predictions, plot data, PNG plots,
  summary.md) and MLflow records.
- `plan`: what the stage resolves from the params once at its entry (`EvaluatePlan`: paths, the engine that
  runs the agents, the environments) and hands to the parts above instead of the whole params.

Imports point one way inside the package: `report` → `costs`, `paper`, `traces`, `verdict` → `scores` →
`systems`; `paper` → `verdict`; `plan` → `costs`, `matrix`, `systems` (the parts name `EvaluatePlan`
only in annotations). Who runs the agents (llama.cpp's server or transformers) is the agent's part:
`pipeline.agent.evaluation_policy`.
"""
