"""The registered agent's model code (MLflow "models from code"): the file `log_model(python_model=<path>)` logs.

MLflow copies this file into the model and runs it at load time, after putting the bundled `pipeline`
package (`code_paths`) on the import path; `set_model` names the pyfunc it builds. So the model is plain
source, not a CloudPickle of a `PromptR1Agent` object: no CloudPickle warning when it is logged, and loading
it does not need `MLFLOW_ALLOW_PICKLE_DESERIALIZATION` (MLflow 3 refuses pickled models by default). The
class itself is pipeline/serving/agent_model.py.

Logging: under a bare scoring server (`mlflow models serve`: uvicorn configures its own loggers only) the
`pipeline` loggers had no handler, so what the agent does at load (its engine, the GGUF export, the llama.cpp
server's start) was never printed; they get one to stderr, only when neither they nor the root logger have any.
"""

import logging

import mlflow.models

from pipeline.serving.agent_model import PromptR1Agent

_pipeline_log = logging.getLogger("pipeline")
if not _pipeline_log.handlers and not logging.getLogger().handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _pipeline_log.addHandler(_handler)
    _pipeline_log.setLevel(logging.INFO)

mlflow.models.set_model(PromptR1Agent())
