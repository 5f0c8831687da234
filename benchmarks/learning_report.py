"""learning.json, learning_steps.csv and learning.png from the per-question files under results/learning/.

Why a separate step: every evaluation of `bench_learning.py` (GRPO at steps 0 / half-way / last per seed, each
control, the trivial rules) is saved per question under `benchmarks/results/learning/<mode>/`, so the figures
and their CIs can be recomputed from the files alone (`python benchmarks/bench_learning.py --report`), and
seeds run in separate processes or sessions are pooled the same way.

Statistics (points of F1/EM, `pipeline.metrics`): a figure over several seeds is the mean over seeds of each
question's score, its 95% CI a bootstrap over questions resampled within each dataset
(`bootstrap_ci_average`); the GRPO gain is the paired bootstrap of (GRPO - warm-up) per question
(`paired_bootstrap_delta`). The CIs reflect question sampling, not seed-to-seed variation: with one seed, they
say nothing about how another seed would do.
Training rollouts (`rollouts.jsonl.gz`, `rollout_requests`): per seed, what the requests sampled during GRPO
got from the environment, so a flat request side can be traced to whether any group held a short request.
Request side: the share of questions whose interaction request got an answer from the environment (not a
refusal, not "unknown": `pipeline.environment.simulated.knowledge_replies.answered`); extraction side: the mean F1
over those questions only.
The `hops` mode (`hops_summary`, learning.json's `hops`) is reported per hop ("1-hop", "2-hop"): every figure
is the mean over seeds of a seed's mean F1 over its questions of that hop; `seed_interval` is a t-interval
(n - 1 degrees of freedom) over the per-seed differences GRPO - the control with the best mean on 2-hop, so it
covers seed-to-seed variation, which the per-question bootstrap does not; `requests` is the share of 2-hop
questions whose second request names the bridge entity and the answer's relation, at each evaluated step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.metrics import bootstrap_ci_average, paired_bootstrap_delta

SAMPLES, CONFIDENCE, SEED = 2000, 0.95, 0


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def pooled(evaluations: list[dict[str, Any]], key: str) -> dict[str, list[float]]:
    """Per dataset, each question's `key` score averaged over `evaluations` (one per seed)."""
    names = list(evaluations[0][key])
    return {n: [sum(vals) / len(vals) for vals in zip(*(e[key][n] for e in evaluations), strict=True)]
            for n in names}


def figure(evaluations: list[dict[str, Any]], key: str = "f1") -> dict[str, Any]:
    """Mean in points with its bootstrap CI, over questions (seeds pooled per question)."""
    scores = pooled(evaluations, key)
    mean, low, high = bootstrap_ci_average(list(scores.values()), SAMPLES, CONFIDENCE, seed=SEED)
    return {"mean": round(100 * mean, 2), "ci": [round(100 * low, 2), round(100 * high, 2)]}


def delta(after: list[dict[str, Any]], before: list[dict[str, Any]], key: str = "f1") -> dict[str, Any]:
    a, b = pooled(after, key), pooled(before, key)
    mean, low, high = paired_bootstrap_delta(list(a.values()), [b[n] for n in a], SAMPLES, CONFIDENCE, seed=SEED)
    return {"mean": round(100 * mean, 2), "ci": [round(100 * low, 2), round(100 * high, 2)]}


def sides(evaluation: dict[str, Any]) -> dict[str, Any]:
    """Request side (share answered) and extraction side (mean F1 where answered) of one evaluation."""
    answered = [a for vs in evaluation["answered"].values() for a in vs]
    f1 = [f for vs in evaluation["f1"].values() for f in vs]
    hit = [f for f, a in zip(f1, answered, strict=True) if a]
    return {"answered_rate": round(sum(answered) / len(answered), 4),
            "f1_when_answered": round(100 * sum(hit) / len(hit), 2) if hit else None,
            "questions_answered": int(sum(answered)), "questions": len(answered)}


def picks(evaluation: dict[str, Any]) -> dict[str, int] | None:
    """What the answers were, against the reply each request got (`replies`; None for files without them):
    `gold` (F1 1), `distractor` (another entry of a `terse` reply, word for word after SQuAD normalisation),
    `other` (neither: made up, or a partial answer), `unanswered` (no reply answered the request). It tells a
    reading that picks the right entry from one that copies any entry, which F1 alone does not."""
    from pipeline.environment.simulated.knowledge_replies import answered
    from pipeline.evaluation.trivial_rules import terse_entries
    from pipeline.metrics import normalize_answer

    if "replies" not in evaluation:
        return None
    out = {"gold": 0, "distractor": 0, "other": 0, "unanswered": 0}
    for name, per_question in evaluation["replies"].items():
        for replies, prediction, f1 in zip(per_question, evaluation["predictions"][name], evaluation["f1"][name],
                                           strict=True):
            heard = [r for r in replies if answered(r)]
            entries = [a for r in heard for _, a in (terse_entries(r) or [])]
            if not heard:
                out["unanswered"] += 1
            elif f1 == 1.0:
                out["gold"] += 1
            elif normalize_answer(prediction) in {normalize_answer(a) for a in entries}:
                out["distractor"] += 1
            else:
                out["other"] += 1
    return out


def control(evaluations: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    f = figure(evaluations)
    return {"heldout_f1": f["mean"], "heldout_f1_ci": f["ci"], **extra,
            "request_side": [{**sides(e), "picks": picks(e)} for e in evaluations]}


def rollout_requests(path: Path) -> dict[str, Any] | None:
    """The request side during training, from a run's `rollouts.jsonl.gz`: per dataset, how many rollouts
    sent a request of at most `terse.MAX_REQUEST_WORDS` words and how many requests were answered; and the
    share answered per GRPO step. It shows whether the groups ever held a reward difference on the request."""
    import gzip

    from pipeline.environment.simulated.knowledge_replies import answered
    from pipeline.environment.simulated.terse import MAX_REQUEST_WORDS

    if not path.is_file():
        return None
    by_dataset: dict[str, dict[str, int]] = {}
    by_step: dict[int, list[float]] = {}
    for line in gzip.decompress(path.read_bytes()).decode("utf-8").splitlines():
        if not line.strip():
            continue
        traj = json.loads(line)
        asks = [t for t in traj["turns"] if t.get("interaction_prompt")]
        hit = any(answered((t.get("environment") or {}).get("text", "")) for t in asks)
        short = any(len(t["interaction_prompt"].split()) <= MAX_REQUEST_WORDS for t in asks)
        counts = by_dataset.setdefault(traj["data_source"], {"rollouts": 0, "short_requests": 0, "answered": 0})
        counts["rollouts"] += 1
        counts["short_requests"] += int(short)
        counts["answered"] += int(hit)
        by_step.setdefault(int(traj["step"]), []).append(float(hit))
    return {"by_dataset": by_dataset,
            "answered_share_by_step": {str(s): round(sum(v) / len(v), 3) for s, v in sorted(by_step.items())}}


def rules_for(folder: Path, questions: int | None) -> Path | None:
    """The older layout's one trivial-rules file for a mode (`trivial_rules_<N>q.json`, N questions), used when
    the seeds have no `trivial_rules.json` of their own; with no seed run, the one on the most rows. Each seed
    now asks its own environment (its store holds its training sample), so the rules are pooled over seeds."""
    if questions is not None:
        path = folder / f"trivial_rules_{questions}q.json"
        return path if path.is_file() else None
    files = sorted(folder.glob("trivial_rules_*q.json"), key=lambda p: int(p.stem.split("_")[-1][:-1]))
    return files[-1] if files else None


def mode_summary(folder: Path) -> dict[str, Any] | None:
    """Everything measured for one environment mode (`folder` = results/learning/<mode>), or None if nothing."""
    if not folder.is_dir():
        return None
    out: dict[str, Any] = {"seeds": [], "per_seed": {}, "controls": {}, "ceilings": {}}
    runs = sorted((p for p in folder.glob("seed*") if (p / "run.json").is_file()), key=lambda p: int(p.name[4:]))
    rule_files = [run / "trivial_rules.json" for run in runs if (run / "trivial_rules.json").is_file()]
    if not rule_files or len(rule_files) < len(runs):  # the older layout: one file for the mode
        legacy = rules_for(folder, load(runs[0] / "run.json")["heldout"]["questions"] if runs else None)
        rule_files = [legacy] if legacy is not None else rule_files
    if rule_files:
        rules = [load(f) for f in rule_files]
        names = list(rules[0]["rules"])
        trivial = {n: figure([r["rules"][n] for r in rules]) for n in names if n in rules[0]["trivial"]}
        best = max(trivial, key=lambda n: trivial[n]["mean"])
        out["controls"]["trivial_rule"] = control(
            [r["rules"][best] for r in rules], rule=best, seeds=len(rules),
            files=[str(f.relative_to(folder)) for f in rule_files],
            all_rules={n: f["mean"] for n, f in trivial.items()})
        for name in names:
            if name not in rules[0]["trivial"]:
                out["ceilings"][name] = control([r["rules"][name] for r in rules],
                                                why=" ".join(rules[0]["informed"][name].split()))
    grpo0, grpo_last, zero, live, curves = [], [], [], [], {}
    for run_dir in runs:
        run = load(run_dir / "run.json")
        seed, last = run["seed"], run["grpo_steps_done"]
        evals = {int(p.stem.split("step")[1]): load(p) for p in run_dir.glob("grpo_step*.json")}
        if 0 not in evals or last not in evals or last == 0:
            continue
        out["seeds"].append(seed)
        grpo0.append(evals[0])
        grpo_last.append(evals[last])
        gain = delta([evals[last]], [evals[0]])
        out["per_seed"][str(seed)] = {
            "grpo_steps": last, "heldout_f1_warmup": figure([evals[0]])["mean"],
            "heldout_f1_grpo": figure([evals[last]])["mean"], "heldout_f1_gain": gain["mean"],
            "heldout_f1_gain_ci": gain["ci"], "timing_s": run.get("timing_s"),
            "request_vs_extraction": {str(s): {**sides(evals[s]), "picks": picks(evals[s])} for s in sorted(evals)},
            "training_requests": {name: rollout_requests(run_dir / f"{prefix}rollouts.jsonl.gz")
                                  for name, prefix in (("grpo", ""), ("zero_advantage", "zero_advantage_"))}}
        curves[str(seed)] = [{"step": s, "f1": round(100 * evals[s]["f1_mean"], 2),
                              "em": round(100 * evals[s]["em_mean"], 2), **sides(evals[s])} for s in sorted(evals)]
        zero_file = run_dir / f"zero_advantage_step{last}.json"
        if zero_file.is_file():
            zero.append(load(zero_file))
        if (run_dir / "warmup_live_replies.json").is_file():
            live.append(load(run_dir / "warmup_live_replies.json"))
    if zero:
        out["controls"]["zero_advantage"] = control(zero, seeds=len(zero))
    if live:
        out["controls"]["warmup_live_replies"] = control(live, seeds=len(live))
    out["curves"] = curves
    if grpo0:
        out["warmup"], out["grpo"] = figure(grpo0), figure(grpo_last)
        out["warmup_em"], out["grpo_em"] = figure(grpo0, "em"), figure(grpo_last, "em")
        out["gain"], out["gain_em"] = delta(grpo_last, grpo0), delta(grpo_last, grpo0, "em")
        out["format_rate"] = [round(sum(e["format_mean"] for e in x) / len(x), 4) for x in (grpo0, grpo_last)]
    return out


def _steps(folder: Path) -> list[dict[str, Any]]:
    """Per GRPO step of every seed: mean reward with a 95% t-interval, parts, calls, step time."""
    import math

    import pandas as pd
    from scipy import stats

    rows = []
    for run_dir in sorted(folder.glob("seed*")):
        if not (run_dir / "steps.csv").is_file():
            continue
        for rec in pd.read_csv(run_dir / "steps.csv").to_dict("records"):
            n = int(rec.get("critic/score/count", 0) or 0)
            mean, std = float(rec["critic/score/mean"]), float(rec.get("critic/score/std", float("nan")))
            half = float(stats.t.ppf(0.975, n - 1) * std / math.sqrt(n)) if n > 1 and math.isfinite(std) else float(
                "nan")
            rows.append({"seed": int(run_dir.name[4:]), "step": int(rec["step"]), "reward_mean": mean,
                         "reward_ci95": [mean - half, mean + half],
                         "reward_parts": {k.split("/")[1]: float(rec[k]) for k in rec if k.startswith("reward/")},
                         "format_rate": float(rec["reward/gated/mean"]), "env_calls": float(rec["env/calls"]),
                         "trajectories": n, "step_s": float(rec["timing_s/step"])})
    return rows


def hops2_summary(folder: Path) -> dict[str, Any] | None:
    """learning.json's `hops2` (benchmarks/hops2_report.py), or None before its first seed."""
    from hops2_report import hops2_summary as summary

    return summary(folder) if folder.is_dir() else None


def build(results: Path, notes: list[str], main_mode: str = "terse") -> dict[str, Any]:
    """learning.json's content: the present keys for `main_mode`'s GRPO (means over seeds), plus `seeds`,
    `controls` (that mode's), `ceilings`, `request_vs_extraction`, `per_seed` and `knowledge` (the question mode)."""
    from pipeline.config import load_params

    learn = load_params(Path(__file__).resolve().parents[1] / "params.yaml", {"profile": "learn"})
    main = mode_summary(results / "learning" / main_mode) or {"seeds": [], "controls": {}, "ceilings": {}}
    other = mode_summary(results / "learning" / "question")
    seeds = main["seeds"]
    runs = [load(results / "learning" / main_mode / f"seed{s}" / "run.json") for s in seeds]
    steps_done = min((r["grpo_steps_done"] for r in runs), default=0)
    has = "grpo" in main
    beats = has and all(main["grpo"]["mean"] > c["heldout_f1"] for c in main["controls"].values())
    target_met = bool(has and beats and main["gain"]["ci"][0] > 0 and set(main["controls"]) >= {
        "trivial_rule", "zero_advantage", "warmup_live_replies"})
    last_seed = str(seeds[-1]) if seeds else None
    examples: dict[str, Any] = {}
    if last_seed:
        run_dir = results / "learning" / main_mode / f"seed{last_seed}"
        examples = {"warmup": load(run_dir / "grpo_step0.json")["examples"],
                    "grpo": load(run_dir / f"grpo_step{runs[-1]['grpo_steps_done']}.json")["examples"]}
    get = lambda key, part: main[key][part] if has else None
    return {
        "what": (f"learning experiment: warm-up-only vs GRPO-trained agent on a fixed held-out set, "
                 f"knowledgeable environment in {main_mode} mode, with controls; top-level figures are means over "
                 f"the seeds in `seeds`"),
        "command": "python benchmarks/bench_learning.py --mode terse --seed N (per seed); --report pools them",
        "environment": f"knowledge ({main_mode} mode)",
        "mode": main_mode,
        "complete": bool(len(seeds) >= 3 and steps_done >= learn.train.steps),
        "profile_steps": learn.train.steps,
        "grpo_steps_evaluated": steps_done,
        "heldout_f1_warmup": get("warmup", "mean"), "heldout_f1_grpo": get("grpo", "mean"),
        "heldout_f1_gain": get("gain", "mean"), "heldout_f1_gain_ci": get("gain", "ci"),
        "heldout_f1_warmup_ci": get("warmup", "ci"), "heldout_f1_grpo_ci": get("grpo", "ci"),
        "heldout_em_warmup": get("warmup_em", "mean"), "heldout_em_grpo": get("grpo_em", "mean"),
        "heldout_em_gain": get("gain_em", "mean"), "heldout_em_gain_ci": get("gain_em", "ci"),
        "heldout_format_rate_warmup": main["format_rate"][0] if has else None,
        "heldout_format_rate_grpo": main["format_rate"][1] if has else None,
        "target": ("in the terse mode, GRPO's mean held-out F1 above every entry of `controls` and the "
                   "gain's paired 95% CI above 0, over at least 3 seeds"),
        "target_met": target_met and len(seeds) >= 3,
        "heldout": runs[0]["heldout"] if runs else None,
        "notes": notes,
        "heldout_curve": [{"seed": int(s), **p} for s, curve in main.get("curves", {}).items() for p in curve],
        "steps": _steps(results / "learning" / main_mode),
        "examples": examples,
        "timing_s": {str(r["seed"]): r["timing_s"] for r in runs},
        "machine": runs[0]["machine"] if runs else None,
        "params": runs[0]["params"] if runs else None,
        "seeds": seeds,
        "controls": main["controls"],
        "ceilings": main["ceilings"],
        "request_vs_extraction": {s: v["request_vs_extraction"] for s, v in main.get("per_seed", {}).items()},
        "per_seed": main.get("per_seed", {}),
        "knowledge": _knowledge(other),
        "hops": hops_summary(results / "learning" / "hops"),
        "hops2": hops2_summary(results / "learning" / "hops2"),
        "unfinished_runs": unfinished(results / "learning" / main_mode),
    }


def t_interval(values: list[float], confidence: float = CONFIDENCE) -> list[float] | None:
    """The t-interval of the mean of `values` (n - 1 degrees of freedom); None with fewer than 2 values."""
    import math

    from scipy import stats

    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return [round(mean - half, 2), round(mean + half, 2)]


def by_hop(evaluation: dict[str, Any], key: str = "f1") -> dict[str, list[float]]:
    """An agent evaluation's per-question `key` scores grouped "1-hop" / "2-hop" by its `questions` (the hops
    world's questions); a rules file is already grouped so."""
    from pipeline.environment.simulated.hops_world import world

    if set(evaluation[key]) <= {"1-hop", "2-hop"}:
        return evaluation[key]
    store, out = world(), {"1-hop": [], "2-hop": []}
    for name, scores in evaluation[key].items():
        for question, score in zip(evaluation["questions"][name], scores, strict=True):
            found = store.question(question)
            if found is None:
                raise ValueError(f"{question!r} is not a question of the hops world")
            out[f"{found.hops}-hop"].append(score)
    return out


def hop_means(evaluation: dict[str, Any]) -> dict[str, float]:
    """Mean F1 in points per hop group of one evaluation."""
    return {hop: 100 * sum(v) / len(v) for hop, v in by_hop(evaluation).items() if v}


def second_requests(evaluation: dict[str, Any]) -> float | None:
    """Share of the 2-hop questions whose second request names both the bridge entity (its words in order)
    and the relation the answer is (a word of `hops_world.RELATION_WORDS`): what the second request must do."""
    from pipeline.environment.simulated.hops_world import RELATION_WORDS, tokens, world

    store, hits, total = world(), 0, 0
    for name, per_question in evaluation["requests"].items():
        for question, asks in zip(evaluation["questions"][name], per_question, strict=True):
            found = store.question(question)
            if found is None or found.hops != 2:
                continue
            total += 1
            if len(asks) < 2:
                continue
            words, bridge = tokens(asks[1]), tokens(found.bridge or "")
            names_bridge = any(words[i: i + len(bridge)] == bridge for i in range(len(words)))
            hits += int(names_bridge and bool(set(words) & RELATION_WORDS[found.relation]))
    return round(hits / total, 4) if total else None


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 2)


def hops_summary(folder: Path) -> dict[str, Any] | None:
    """learning.json's `hops`: per seed, the last GRPO step, the warm-up, the agent controls and every rule,
    per hop, pooled as means over seeds (each seed's mean over its questions); the seed-level interval;
    the request side; the PopQA transfer check. None when no seed finished."""
    runs = sorted((p for p in folder.glob("seed*") if (p / "run.json").is_file()), key=lambda p: int(p.name[4:]))
    seeds, per_seed, requests, transfer = [], {}, {}, {}
    two_hop: dict[str, dict[str, dict[str, Any]]] = {}  # seed -> system -> {"f1": {"2-hop": per question}}
    for run_dir in runs:
        run = load(run_dir / "run.json")
        last = run["grpo_steps_done"]
        evals = {int(p.stem.split("step")[1]): load(p) for p in run_dir.glob("grpo_step*.json")}
        if 0 not in evals or last not in evals or last == 0:
            continue
        seed = str(run["seed"])
        seeds.append(run["seed"])
        systems = {"grpo": evals[last], "warmup": evals[0]}
        for control in ("warmup_continued", "warmup_live_replies"):
            if (run_dir / f"{control}.json").is_file():
                systems[control] = load(run_dir / f"{control}.json")
        rules = load(run_dir / "trivial_rules.json") if (run_dir / "trivial_rules.json").is_file() else None
        references = {}
        if rules is not None:
            systems.update({name: rules["rules"][name] for name in rules["trivial"]})
        figures = {name: hop_means(e) for name, e in systems.items()}
        two_hop[seed] = {name: {"f1": {"2-hop": by_hop(e)["2-hop"]}} for name, e in systems.items()}
        if rules is not None:
            references = {name: hop_means(rules["rules"][name]) for name in rules["references"]}
        requests[seed] = {str(step): second_requests(e) for step, e in sorted(evals.items())}
        curve = {str(step): {**{h: round(f, 2) for h, f in hop_means(e).items()}, "second_requests": requests[seed][
            str(step)]} for step, e in sorted(evals.items())}
        per_seed[seed] = {"per_hop": figures, "references": references, "grpo_steps": last, "curve": curve,
                          "health_breach": run.get("health_breach"), "timing_s": run.get("timing_s")}
        files = {p.stem.removeprefix("transfer_"): p for p in run_dir.glob("transfer_*.json")}
        if files:
            seen = {name: 100 * load(p)["f1_mean"] for name, p in files.items() if name != "rules"}
            if "rules" in files:
                rule_file = load(files["rules"])
                seen.update({name: hop_means(rule_file["rules"][name])["2-hop"] for name in rule_file["rules"]})
            transfer[seed] = seen
    if not seeds:
        return None
    names = [n for n in per_seed[str(seeds[0])]["per_hop"] if all(n in v["per_hop"] for v in per_seed.values())]
    per_hop = {hop: {name: _mean([v["per_hop"][name][hop] for v in per_seed.values()]) for name in names}
               for hop in ("1-hop", "2-hop")}
    ref_names = [n for n in per_seed[str(seeds[0])]["references"] if all(n in v["references"] for v in per_seed.values())]
    references = {hop: {n: _mean([v["references"][n][hop] for v in per_seed.values()]) for n in ref_names}
                  for hop in ("1-hop", "2-hop")}
    controls = [n for n in names if n not in ("grpo", "warmup")]
    best = max(controls, key=lambda n: per_hop["2-hop"][n]) if controls else None
    differences = [v["per_hop"]["grpo"]["2-hop"] - v["per_hop"][best]["2-hop"] for v in per_seed.values()] if best else []
    steps = sorted({s for r in requests.values() for s in r}, key=int)
    shares = {s: v for s in steps if (v := [r[s] for r in requests.values() if r.get(s) is not None])}
    finals = [r[last] for r in requests.values() if r and r[last := max(r, key=int)] is not None]
    kinds = {n: "agent" if n.startswith("warmup_") else "trivial" for n in controls}
    transfer_names = sorted({n for v in transfer.values() for n in v})
    return {
        "seeds": seeds,
        "controls": {n: {"kind": kinds[n], **{hop: per_hop[hop][n] for hop in per_hop}} for n in controls},
        "per_hop": per_hop,
        "references": references,
        "seed_interval": {"2-hop": t_interval(differences)},
        "bootstrap_2hop": {"what": "per-question bootstrap over the 2-hop held-out questions (seeds pooled per "
                                   "question): GRPO, the best control, and GRPO minus it (paired)",
                           "grpo": figure([v["grpo"] for v in two_hop.values()]),
                           best: figure([v[best] for v in two_hop.values()]),
                           "grpo_minus_best": delta([v["grpo"] for v in two_hop.values()],
                                                    [v[best] for v in two_hop.values()])} if best else None,
        "seed_interval_against": best,
        "seed_differences_2hop": [round(d, 2) for d in differences],
        "requests": {"what": "share of 2-hop held-out questions whose second request names the bridge entity "
                             "and the answer's relation, per GRPO step (mean over the seeds evaluated at that "
                             "step: seeds_by_step) and at each seed's last evaluated step (final: GRPO's result)",
                     "by_step": {s: _mean(v) for s, v in shares.items()},
                     "seeds_by_step": {s: len(v) for s, v in shares.items()},
                     "final": _mean(finals) if finals else None,
                     "per_seed": requests},
        "transfer_popqa": {"what": "2-hop chains composed from PopQA's facts (benchmarks/hops_transfer.py): mean "
                                   "F1 per system, mean over seeds",
                           **{n: _mean([v[n] for v in transfer.values() if n in v]) for n in transfer_names},
                           "per_seed": transfer} if transfer else None,
        "per_seed": per_seed,
    }


def unfinished(folder: Path) -> dict[str, Any]:
    """Seeds stopped before their last GRPO evaluation (no run.json): what they evaluated, never pooled."""
    out: dict[str, Any] = {}
    for run_dir in sorted(p for p in folder.glob("seed*") if not (p / "run.json").is_file()):
        evals = {p.stem: load(p) for p in sorted(run_dir.glob("*.json")) if p.name != "trivial_rules.json"}
        if not evals:  # a `--rules-only` folder: no agent evaluated
            continue
        out[run_dir.name] = {name: {"f1": round(100 * e["f1_mean"], 2), "em": round(100 * e["em_mean"], 2),
                                    "format_rate": round(e["format_mean"], 4), **sides(e),
                                    "seconds": round(e.get("seconds", 0.0), 1)} for name, e in evals.items()}
    return out


def _knowledge(summary: dict[str, Any] | None) -> dict[str, Any]:
    """The same figures for the `question` mode (what was measured of it at this code; nulls where not run)."""
    if summary is None:
        return {"mode": "question", "seeds": [], "controls": {}, "note": "not measured at this code"}
    has = "grpo" in summary
    return {"mode": "question", "seeds": summary["seeds"],
            "heldout_f1_warmup": summary["warmup"]["mean"] if has else None,
            "heldout_f1_warmup_ci": summary["warmup"]["ci"] if has else None,
            "heldout_f1_grpo": summary["grpo"]["mean"] if has else None,
            "heldout_f1_grpo_ci": summary["grpo"]["ci"] if has else None,
            "heldout_f1_gain": summary["gain"]["mean"] if has else None,
            "heldout_f1_gain_ci": summary["gain"]["ci"] if has else None,
            "controls": summary["controls"], "ceilings": summary["ceilings"],
            "request_vs_extraction": {s: v["request_vs_extraction"] for s, v in summary["per_seed"].items()}}


def write_report(results: Path, notes: list[str], main_mode: str = "terse") -> dict[str, Any]:
    """Write learning.json, learning_steps.csv and learning.png under `results`; return the json's content."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    old = results / "learning.json"
    previous = load(old).get("notes", []) if old.is_file() else []
    result = build(results, [*dict.fromkeys([*previous, *notes])], main_mode)
    (results / "learning.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    columns = ["seed", "step", "reward_mean", "reward_low", "reward_high", "format_rate", "env_calls", "answer_f1",
               "heldout_f1", "heldout_answered_rate"]
    held = {(p["seed"], p["step"]): p for p in result["heldout_curve"]}
    frame = pd.DataFrame(columns=columns, data=[{
        "seed": s["seed"], "step": s["step"], "reward_mean": s["reward_mean"], "reward_low": s["reward_ci95"][0],
        "reward_high": s["reward_ci95"][1], "format_rate": s["format_rate"], "env_calls": s["env_calls"],
        "answer_f1": s["reward_parts"].get("answer", float("nan")),
        "heldout_f1": held.get((s["seed"], s["step"]), {}).get("f1", float("nan")),
        "heldout_answered_rate": held.get((s["seed"], s["step"]), {}).get("answered_rate", float("nan")),
    } for s in result["steps"]] or None)
    frame.to_csv(results / "learning_steps.csv", index=False)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for seed, rows in frame.groupby("seed"):
        top.plot(rows["step"], rows["reward_mean"], marker=".", label=f"mean reward, seed {seed}")
        top.fill_between(rows["step"], rows["reward_low"], rows["reward_high"], alpha=0.2)
    top.set_ylabel("training reward (released)")
    top.legend(loc="lower right", fontsize=8)
    curve = pd.DataFrame(result["heldout_curve"])
    for k, (seed, rows) in enumerate(curve.groupby("seed") if len(curve) else []):
        color = f"C{k}"
        bottom.plot(rows["step"], rows["f1"], marker="o", color=color, label=f"held-out F1, seed {seed}")
        bottom.plot(rows["step"], 100 * rows["answered_rate"], linestyle="--", color=color,
                    label=f"% requests answered (request side), seed {seed}")
        bottom.plot(rows["step"], rows["f1_when_answered"].astype(float), linestyle="-.", marker="x", color=color,
                    label=f"F1 when answered (extraction side), seed {seed}")
    last = max((p["step"] for p in result["heldout_curve"]), default=0)
    for name, c in result["controls"].items():
        bottom.axhline(c["heldout_f1"], linestyle=":", color="grey")
        bottom.annotate(f"{name} F1 {c['heldout_f1']:.1f}", (last, c["heldout_f1"]), fontsize=7, color="grey",
                        ha="right", va="bottom")
    bottom.set_xlabel("GRPO step (0 = warm-up only)")
    bottom.set_ylabel("points")
    bottom.legend(loc="upper left", fontsize=6, ncol=2)
    n = len(result["seeds"])
    fig.suptitle(f"GRPO, knowledge environment ({result['mode']} mode): {n} seed{'s' * (n != 1)}, "
                 f"{result['grpo_steps_evaluated']} steps")
    fig.tight_layout()
    fig.savefig(results / "learning.png", dpi=110)
    plt.close(fig)
    if result.get("hops"):
        plot_hops(result["hops"], results / "learning_hops.png")
    if result.get("hops2"):
        from hops2_report import plot_hops2

        plot_hops2(results / "learning" / "hops2", result["hops2"], results / "learning_hops2.png")
    return result


def plot_hops(hops: dict[str, Any], path: Path) -> None:
    """learning_hops.png: per seed, held-out 2-hop F1 and the share of second requests naming the bridge and
    the relation at each evaluated GRPO step, beside the controls' 2-hop means."""
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps: list[int] = []
    for k, (seed, v) in enumerate(hops["per_seed"].items()):
        xs = sorted(int(s) for s in v["curve"])
        steps += xs
        top.plot(xs, [v["curve"][str(x)].get("2-hop") for x in xs], marker="o", color=f"C{k}", label=f"seed {seed}")
        bottom.plot(xs, [100 * (v["curve"][str(x)]["second_requests"] or 0) for x in xs], marker="o",
                    color=f"C{k}", label=f"seed {seed}")
    for name, figure_2hop in hops["per_hop"]["2-hop"].items():
        if name not in ("grpo", "warmup"):
            top.axhline(figure_2hop, linestyle=":", color="grey")
            top.annotate(f"{name} {figure_2hop:.1f}", (max(steps, default=0), figure_2hop), fontsize=6, color="grey",
                         ha="right", va="bottom")
    top.set_ylabel("held-out 2-hop F1")
    top.legend(loc="upper left", fontsize=7)
    bottom.set_ylabel("% second requests naming\nthe bridge and the relation")
    bottom.set_xlabel("GRPO step (0 = warm-up only)")
    fig.suptitle(f"GRPO, knowledge environment (hops mode): seeds {hops['seeds']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
