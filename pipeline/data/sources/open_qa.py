"""Open QA sources: PopQA (trains), SQuAD v2 and TriviaQA (out-of-distribution evaluation only).

PopQA has one split (test), so its training rows come from it; the sample stage's leakage filter removes
the authors' evaluation rows. SQuAD v2 is the only dataset with a context passage; its Hub answers sit in
a nested field (`answers.text`).
"""

from __future__ import annotations

from pipeline.data.sources.registry import HubSource, flashrag, register

register("popqa", "open_qa", trains=True, hub=flashrag("popqa", "test"), mirror="popqa/test.parquet",
         eval_file="PopQA.parquet", eval_tag="PopQA-256-test",
         note="one split only; the authors' eval rows are removed by the leakage filter")
register("squad_v2", "open_qa", trains=False,
         hub=HubSource("rajpurkar/squad_v2", split="validation", id="id", question="question", answers="answers.text", context="context"),
         mirror="squad_v2/dev.parquet", eval_file="squad_v2_ood.parquet", eval_tag="squad_v2-128-eval_ood")
register("triviaqa", "open_qa", trains=False, hub=flashrag("triviaqa", "test"),
         mirror="triviaqa/test_subsample1000.parquet", eval_file="triviaqa_ood.parquet",
         eval_tag="triviaqa_train-128-eval_ood")
