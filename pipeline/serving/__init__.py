"""The registered agent as an MLflow pyfunc model (`agent_model`) and the models-from-code file MLflow loads it
from (`model_code`)."""
