"""The pipeline's stages, one module each, named as its `dvc.yaml` stage and its `promptr1` command.

Each module has one entry, `run_<stage>(params)`, that reads top to bottom: resolve the stage's plan from the
params, open the stage's MLflow run where it has one, run the steps. The work itself lives in the libraries
below (`data`, `train`, `evaluation`, `agent`, `environment`, `tracking`, `serving`); nothing there imports a
stage module. `figures` reads each stage's key figure back from what it wrote (the CLI's and the flow's last
line for a stage).
"""
