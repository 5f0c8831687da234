"""Multi-hop QA sources: 2WikiMultihopQA, HotpotQA and MuSiQue, all from FlashRAG's collection on the Hub.

The mirror holds only the dev split of 2WikiMultihopQA and HotpotQA (no train split): the sample stage's
leakage filter removes the authors' evaluation rows from them. No source quirks: FlashRAG's rows are
already question + list of golden answers.
"""

from __future__ import annotations

from pipeline.data.sources.registry import flashrag, register

register("2wikimultihopqa", "multi_hop_qa", trains=True, hub=flashrag("2wikimultihopqa", "train"),
         mirror="2wikimultihopqa/dev.parquet", eval_file="2WikiMultihopQA.parquet",
         eval_tag="2WikiMultihopQA-256-test",
         note="mirror: dev split only (no train); the authors' eval rows are removed by the leakage filter")
register("hotpotqa", "multi_hop_qa", trains=True, hub=flashrag("hotpotqa", "train"),
         mirror="hotpotqa/dev.parquet", eval_file="hotpot.parquet", eval_tag="hotpot-256-test",
         note="mirror: distractor dev split only (no train)")
register("musique", "multi_hop_qa", trains=True, hub=flashrag("musique", "train"),
         mirror="musique/train.parquet", eval_file="MusiQue.parquet", eval_tag="MusiQue-256-test")
