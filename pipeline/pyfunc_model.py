"""The registered agent's model code (MLflow "models from code"): the file `log_model(python_model=<path>)` logs.

MLflow copies this file into the model and runs it at load time, after putting the bundled `pipeline`
package (`code_paths`) on the import path; `set_model` names the pyfunc it builds. So the model is plain
source, not a CloudPickle of a `PromptR1Agent` object: no CloudPickle warning when it is logged, and loading
it does not need `MLFLOW_ALLOW_PICKLE_DESERIALIZATION` (MLflow 3 refuses pickled models by default). The
class itself is pipeline/pyfunc_agent.py.
"""

import mlflow.models

from pipeline.pyfunc_agent import PromptR1Agent

mlflow.models.set_model(PromptR1Agent())
