"""How faithfully llama.cpp computes the agent from each GGUF export type (f16, q8_0, ...).

    python benchmarks/bench_gguf_fidelity.py [--dtypes f32,f16,q8_0] [--out benchmarks/results/gguf_fidelity.json]

The default profile's agent (SmolLM2-135M-Instruct from its bundled GGUF, dequantised by transformers, float32)
is exported by pipeline.agent.gguf_export in each type and read back by llama.cpp (llama-cpp-python); on a
Prompt-R1-style conversation it reports, against transformers' float32 logits: the largest logit difference,
the mean and largest |log-prob difference| of the conversation's own next tokens, and the share of positions
whose most likely token is the same. Speed of each type: benchmarks/bench_agent_server.py --dtypes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONVERSATION = (
    "<|im_start|>user\nQuestion: Which river flows through Paris, and what is the capital of Italy? Think step "
    "by step.<|im_end|>\n<|im_start|>assistant\n<think>The river that flows through Paris is the Seine. The "
    "capital of Italy is Rome.</think>\n<answer>Seine; Rome</answer><|im_end|>"
)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="f32,f16,q8_0")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gguf_fidelity.json"))
    args = parser.parse_args()

    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    from pipeline.agent.gguf_export import export_gguf
    from pipeline.config import load_params
    from pipeline.modelref import load_tokenizer, resolve_model

    ref = load_params(ROOT / "params.yaml").agent.model
    resolved = resolve_model(ref, ROOT)
    model = AutoModelForCausalLM.from_pretrained(resolved.directory, dtype=torch.float32,
                                                 **resolved.from_pretrained_kwargs()).eval()
    ids = load_tokenizer(ref, ROOT)(CONVERSATION)["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float().numpy()
    positions, targets = np.arange(len(ids) - 1), np.array(ids[1:])
    want_lp = _log_softmax(want[:-1])[positions, targets]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model.save_pretrained(tmp / "agent")
        for dtype in args.dtypes.split(","):
            path = export_gguf(tmp / "agent", resolved.location, tmp / f"agent-{dtype}.gguf", dtype)
            llm = Llama(str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
            try:
                llm.eval(ids)
                got = np.array(llm.scores[: len(ids)], dtype=np.float32)
            finally:
                llm.close()
            diff = np.abs(_log_softmax(got[:-1])[positions, targets] - want_lp)
            row = {"dtype": dtype, "file_mb": round(path.stat().st_size / 1e6, 1), "tokens": len(ids),
                   "max_logit_diff": round(float(np.abs(got - want).max()), 4),
                   "token_logprob_abs_diff_mean": round(float(diff.mean()), 4),
                   "token_logprob_abs_diff_max": round(float(diff.max()), 4),
                   "argmax_agreement": round(float((got.argmax(-1) == want.argmax(-1)).mean()), 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = {"what": f"llama.cpp on GGUF exports of {ref} (float32 in transformers) vs transformers' float32 logits",
           "command": f"python benchmarks/bench_gguf_fidelity.py --dtypes {args.dtypes}", "results": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
