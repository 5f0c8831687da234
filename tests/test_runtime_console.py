"""pipeline.runtime: known-benign third-party warnings are hidden unless -v; real warnings always show."""

from __future__ import annotations

import subprocess
import sys

SNIPPET = """
import logging, sys, warnings
from pipeline.runtime import configure_logging
configure_logging(verbose=sys.argv[1] == "v")
warnings.warn("The specified dataset source can be interpreted in multiple ways: A, B", UserWarning)
warnings.warn("\\x1b[1;33mAn input example was not provided when logging the model.", UserWarning)
logging.getLogger("mlflow.transformers").warning("The model card could not be retrieved from the hub due to x")
logging.getLogger("pipeline.stages.register").warning("Unable to find license information for this model.")
logging.getLogger("mlflow.transformers").warning("a real mlflow warning")
logging.getLogger("pipeline.train").warning("a real pipeline warning")
"""


def _stderr(mode: str, repo_root) -> str:
    proc = subprocess.run([sys.executable, "-c", SNIPPET, mode], cwd=repo_root, capture_output=True, text=True,
                          timeout=120, check=True)
    return proc.stderr


def test_benign_warnings_hidden_real_ones_kept(repo_root):
    quiet = _stderr("q", repo_root)
    assert "a real mlflow warning" in quiet and "a real pipeline warning" in quiet
    for benign in ("interpreted in multiple ways", "input example", "model card", "license information"):
        assert benign not in quiet, quiet


def test_verbose_shows_everything(repo_root):
    loud = _stderr("v", repo_root)
    for text in ("interpreted in multiple ways", "input example", "model card", "license information",
                 "a real mlflow warning", "a real pipeline warning"):
        assert text in loud, loud
