"""Dataset sources: every dataset the pipeline knows, registered once by its family, and one reader for all.

Layout:
- `registry.py`: what a dataset is (`DatasetSpec`: task type, Hub split and field mapping, mirror file,
  the authors' evaluation file) and `register(...)`, the one way to declare one.
- One module per source family, each registering its datasets with their source quirks (converters) and
  the task the authors' rows pose (task formats): `multi_hop_qa` (2WikiMultihopQA, HotpotQA, MuSiQue),
  `open_qa` (PopQA, SQuAD v2, TriviaQA), `math_problems` (GSM8K, DAPO-Math, MathQA), `long_form`
  (BookSum, WritingPrompts, XSum), `synthetic` (the generated `hops` world). Adding a dataset is one `register(...)` call in its family's module
  (and, for a new kind of source, a new family module imported below).
- `reading.py`: a dataset's raw records from the local mirror (`paths.mirror` set) or the Hub.
- `authors_eval.py`: the authors' 128-row evaluation files, read back into our terms.
- `generated.py`: a generated dataset's rows written as files in the mirror's and the authors' layouts.

`REGISTRY` lists the datasets in the order of the paper's tables (`PAPER_ORDER`; params.yaml's dataset
lists follow it, fingerprints and the leakage check walk it), not in the families' import order.
Training rows come from a source's only split when it has no train split (2WikiMultihopQA and HotpotQA
dev, PopQA test): the leakage filter in the sample stage removes the authors' evaluation rows.
"""

from __future__ import annotations

from pipeline.data.sources import long_form, math_problems, multi_hop_qa, open_qa, synthetic
from pipeline.data.sources.authors_eval import (
    AUTHORS_EVAL_URL,
    EVAL_COLUMNS,
    authors_eval_path,
    load_authors_eval,
    normalised_eval_row,
)
from pipeline.data.sources.reading import RawSource, SourcePaths, load_raw, read_mirror_file
from pipeline.data.sources.registry import (
    MIRROR_COLUMNS,
    PAPER_ORDER,
    REGISTRY,
    BadRow,
    Converter,
    DatasetSpec,
    GeneratedSource,
    HubSource,
    MetricFamily,
    MirrorSource,
    RawRecord,
    TaskType,
    get_spec,
    register,
)

__all__ = [
    "AUTHORS_EVAL_URL",
    "EVAL_COLUMNS",
    "MIRROR_COLUMNS",
    "PAPER_ORDER",
    "REGISTRY",
    "BadRow",
    "Converter",
    "DatasetSpec",
    "GeneratedSource",
    "HubSource",
    "MetricFamily",
    "MirrorSource",
    "RawRecord",
    "RawSource",
    "SourcePaths",
    "TaskType",
    "authors_eval_path",
    "get_spec",
    "load_authors_eval",
    "load_raw",
    "long_form",
    "math_problems",
    "multi_hop_qa",
    "normalised_eval_row",
    "open_qa",
    "read_mirror_file",
    "register",
    "synthetic",
]
