"""Does bf16 autocast weaken the GRPO update? The CI direction check, over seeds, warm-up x update precision.

`tests/test_learning.py` checks that one GRPO update raises the likelihood of above-average trajectories
(Pearson correlation of advantage vs likelihood change > 0.5 on one seed). With `train.autocast: bfloat16`
that single check once read 0.458: this benchmark asks whether that is the update's precision or the
starting model, by running the same check for several rollout seeds on each combination of

- warm-up precision (the fixture's format warm-up in float32 or under bf16 autocast: two different starting
  models), and
- update precision (the GRPO update in float32 or under bf16 autocast, from the same starting model).

Everything is the test's own setup (tiny random Llama, knowledgeable environment server on 127.0.0.1, the
`released` reward, `pipeline.train` unchanged).

Run: `python benchmarks/bench_autocast_direction.py [--seeds 1 2 3 4 5] [--out benchmarks/results/autocast_direction.json]`
(~10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PRECISIONS = {"float32": None, "bfloat16": "bfloat16"}


def warm_model(folder: Path, tiny: Path, url: str, autocast: str | None) -> Path:
    """The test fixture's format warm-up, with `train.autocast` set as asked."""
    import test_learning as tl

    from pipeline.train.local.backend import WARMUP_DIR, train_local
    from pipeline.train.plan import TrainPlan

    _ = tl._train_parquet(folder / "data/rl/train.parquet")
    params = tl._params(folder, tiny, url, autocast=autocast,
                        warmup={"steps": tl.WARMUP_STEPS, "batch_size": tl.WARMUP_BATCH, "lr": tl.WARMUP_LR,
                                "demonstrations": tl.WARMUP_DEMOS, "interaction_turns": 1, "max_answer_tokens": 8})
    train_local(TrainPlan.from_params(params), max_steps=0)
    model_dir = folder / "checkpoints" / WARMUP_DIR / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, model_dir / name)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--warmups", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--updates", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/autocast_direction.json")
    args = parser.parse_args(argv)

    import test_learning as tl
    from demo_project import free_port, write_tiny_llama
    from helpers import knowledge_server_overrides, server_spec

    from pipeline.config import load_params
    from pipeline.environment.servers import serve_environment

    results: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autocast_direction_") as tmp:
        tmp = Path(tmp)
        tiny = write_tiny_llama(tmp / "tiny")
        env_params = load_params(ROOT / "params.yaml", knowledge_server_overrides(tmp / "env", tl.TASK, free_port()))
        with serve_environment(server_spec(env_params)) as url:
            for warm_name in args.warmups:
                model_dir = warm_model(tmp / f"warm_{warm_name}", tiny, url, PRECISIONS[warm_name])
                for update_name in args.updates:
                    update_autocast = PRECISIONS[update_name]
                    for seed in args.seeds:
                        folder = tmp / f"run_{warm_name}_{update_name}_{seed}"
                        original = tl._params

                        def with_autocast(*a, _orig=original, _ac=update_autocast, **kw):
                            return _orig(*a, autocast=_ac, **kw)

                        tl._params = with_autocast
                        try:
                            stats = tl.direction(model_dir, url, folder, lora=False, seed=seed)
                        except AssertionError as err:  # too few trajectories with a signal
                            stats = {"error": str(err)}
                        finally:
                            tl._params = original
                        row = {"warmup": warm_name, "update": update_name, "seed": seed, **stats}
                        results.append(row)
                        print(json.dumps(row), flush=True)

    summary = {}
    for warm_name in args.warmups:
        for update_name in args.updates:
            rows = [r for r in results if r["warmup"] == warm_name and r["update"] == update_name and "error" not in r]
            corr = [r["correlation"] for r in rows]
            summary[f"warmup={warm_name},update={update_name}"] = {
                "runs": len(rows),
                "correlation_mean": round(statistics.fmean(corr), 3) if corr else None,
                "correlation_min": round(min(corr), 3) if corr else None,
                "passes_0.5": sum(c > tl.MIN_CORRELATION for c in corr),
                "surrogate_positive": sum(r["surrogate"] > 0 for r in rows),
                "n_mean": round(statistics.fmean(r["n"] for r in rows), 1) if rows else None,
                "reward_mean": round(statistics.fmean(r["reward_mean"] for r in rows), 3) if rows else None,
            }
    out = {"what": "GRPO direction check (tests/test_learning.py) over seeds: warm-up x update precision",
           "command": "python benchmarks/bench_autocast_direction.py " + " ".join(sys.argv[1:]),
           "min_correlation": tl.MIN_CORRELATION, "summary": summary, "runs": results,
           "wall_s": round(time.monotonic() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
