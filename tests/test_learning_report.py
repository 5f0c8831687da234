"""benchmarks/learning_report.py: learning.json pooled from per-question files, worked by hand on a tiny set.

Why: the learning result is only as good as its bookkeeping. Each control must land under its own name, the
GRPO figures must be the last evaluated step against step 0, the request side must count the questions
whose request was answered and the extraction side average F1 over those only, and a run that stopped
before its controls must not invent them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from learning_report import build, picks, rollout_requests, sides


def evaluation(f1: list[float], answered: list[float]) -> dict:
    """An evaluation file: two datasets of two questions each."""
    return {"f1": {"a": f1[:2], "b": f1[2:]}, "em": {"a": f1[:2], "b": f1[2:]},
            "format": {"a": [1.0, 1.0], "b": [1.0, 1.0]}, "answered": {"a": answered[:2], "b": answered[2:]},
            "f1_mean": sum(f1) / 4, "em_mean": sum(f1) / 4, "format_mean": 1.0,
            "answered_mean": sum(answered) / 4, "examples": [{"question": "q"}]}


def write(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content), encoding="utf-8")


@pytest.fixture
def results(tmp_path):
    mode = tmp_path / "learning" / "terse"
    write(mode / "trivial_rules_4q.json", {
        "trivial": ["question+full_reply", "question+first_sentence"],
        "rules": {"question+full_reply": evaluation([0.1, 0.1, 0.1, 0.1], [1, 1, 0, 0]),
                  "question+first_sentence": evaluation([0.2, 0.2, 0.2, 0.2], [1, 1, 0, 0]),
                  "content_words+label_match": evaluation([1, 1, 1, 1], [1, 1, 1, 1])},
        "informed": {"content_words+label_match": "Not a trivial rule"}})
    seed = mode / "seed1"
    write(seed / "run.json", {"seed": 1, "grpo_steps_done": 2, "timing_s": {}, "heldout": {"questions": 4},
                              "machine": {}, "params": {}})
    write(seed / "grpo_step0.json", evaluation([0.0, 0.0, 0.5, 0.0], [0, 0, 1, 0]))
    write(seed / "grpo_step1.json", evaluation([0.5, 0.0, 0.5, 0.0], [1, 0, 1, 0]))
    write(seed / "grpo_step2.json", evaluation([1.0, 0.5, 0.5, 0.0], [1, 1, 1, 0]))
    write(seed / "zero_advantage_step2.json", evaluation([0.0, 0.0, 0.5, 0.0], [0, 0, 1, 0]))
    write(mode / "seed2" / "grpo_step0.json", evaluation([0.0, 0.0, 0.0, 1.0], [0, 0, 0, 1]))  # stopped early
    return tmp_path


def test_request_and_extraction_sides_by_hand():
    side = sides(evaluation([1.0, 0.5, 0.5, 0.0], [1, 1, 1, 0]))
    assert side == {"answered_rate": 0.75, "f1_when_answered": pytest.approx(100 * 2 / 3, abs=0.01),
                    "questions_answered": 3, "questions": 4}
    assert sides(evaluation([0, 0, 0, 0], [0, 0, 0, 0]))["f1_when_answered"] is None


def test_learning_json_from_the_files(results):
    out = build(results, ["a note"])
    assert out["seeds"] == [1] and out["grpo_steps_evaluated"] == 2 and not out["complete"]
    assert out["heldout_f1_warmup"] == 12.5 and out["heldout_f1_grpo"] == 50.0 and out["heldout_f1_gain"] == 37.5
    # the best trivial rule, by mean F1; the informed rule is a ceiling, not a control
    assert out["controls"]["trivial_rule"]["rule"] == "question+first_sentence"
    assert out["controls"]["trivial_rule"]["heldout_f1"] == 20.0
    assert "content_words+label_match" in out["ceilings"]
    assert out["controls"]["zero_advantage"]["heldout_f1"] == 12.5
    assert "warmup_live_replies" not in out["controls"]  # not run: not invented
    assert not out["target_met"]  # one seed, a control missing
    assert [p["step"] for p in out["heldout_curve"]] == [0, 1, 2]
    assert out["request_vs_extraction"]["1"]["2"]["answered_rate"] == 0.75
    assert out["knowledge"]["seeds"] == [] and out["notes"] == ["a note"]
    # a seed stopped before its last evaluation is listed apart, never pooled
    assert out["unfinished_runs"]["seed2"]["grpo_step0"]["f1"] == 25.0 and out["seeds"] == [1]
    for key in ("heldout_f1_gain_ci", "heldout_f1_warmup_ci", "heldout_f1_grpo_ci"):
        low, high = out[key]
        assert low <= out[key.replace("_ci", "")] <= high


def test_training_requests_count_short_and_answered_requests_by_hand(tmp_path):
    import gzip

    from pipeline.environment.simulated.terse import TOO_LONG_REPLY

    refused = TOO_LONG_REPLY.format(words=12, limit=8)

    def traj(step, source, request, reply):
        return {"step": step, "data_source": source, "turns": [
            {"interaction_prompt": request, "environment": {"text": reply}}, {"interaction_prompt": None}]}

    lines = [traj(1, "hotpotqa", "a b c d e f g h i j k l", refused),
             traj(1, "hotpotqa", "Naranjo occupation", "On naranjo my notes give psychiatrist."),
             traj(2, "popqa", "Who wrote Dune?", "Herbert is listed under dune wrote."),
             traj(2, "popqa", "Who is it", "I'm sorry, I don't know which question you mean. Please restate the "
                                          "full question you want answered.")]
    path = tmp_path / "rollouts.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(t) + "\n" for t in lines).encode()))
    got = rollout_requests(path)
    assert got["by_dataset"] == {"hotpotqa": {"rollouts": 2, "short_requests": 1, "answered": 1},
                                 "popqa": {"rollouts": 2, "short_requests": 2, "answered": 1}}
    assert got["answered_share_by_step"] == {"1": 0.5, "2": 0.5}
    assert rollout_requests(tmp_path / "missing.jsonl.gz") is None


def test_trivial_rules_are_pooled_over_the_seeds_own_environments(results):
    """Each seed's environment knows its own training sample, so each seed keeps its own rules' file; the
    control is the rule with the best mean over seeds, per question, and a rules-only folder is not a run."""
    mode = results / "learning" / "terse"
    rules = lambda full, first: {
        "trivial": ["question+full_reply", "question+first_sentence"],
        "rules": {"question+full_reply": evaluation(full, [1, 1, 0, 0]),
                  "question+first_sentence": evaluation(first, [1, 1, 0, 0]),
                  "content_words+label_match": evaluation([1, 1, 1, 1], [1, 1, 1, 1])},
        "informed": {"content_words+label_match": "Not a trivial rule"}}
    write(mode / "seed1" / "trivial_rules.json", rules([0.4, 0.4, 0.4, 0.4], [0.2, 0.2, 0.2, 0.2]))
    seed3 = mode / "seed3"
    write(seed3 / "run.json", {"seed": 3, "grpo_steps_done": 2, "timing_s": {}, "heldout": {"questions": 4},
                               "machine": {}, "params": {}})
    for step in (0, 2):
        write(seed3 / f"grpo_step{step}.json", evaluation([0.0, 0.0, 0.0, 0.0], [0, 0, 0, 0]))
    write(seed3 / "trivial_rules.json", rules([0.0, 0.0, 0.0, 0.0], [0.3, 0.3, 0.3, 0.3]))
    write(mode / "seed4" / "trivial_rules.json", rules([1, 1, 1, 1], [1, 1, 1, 1]))  # --rules-only: no run
    out = build(results, [])
    assert out["seeds"] == [1, 3]
    trivial = out["controls"]["trivial_rule"]
    # full reply: (0.4 + 0.0) / 2 = 20.0; first sentence: (0.2 + 0.3) / 2 = 25.0 -> the best is first sentence
    assert trivial["rule"] == "question+first_sentence" and trivial["heldout_f1"] == 25.0
    assert trivial["all_rules"] == {"question+full_reply": 20.0, "question+first_sentence": 25.0}
    assert trivial["seeds"] == 2 and trivial["files"] == ["seed1/trivial_rules.json", "seed3/trivial_rules.json"]
    assert "seed4" not in out["unfinished_runs"]


def test_picks_tell_the_right_entry_from_a_distractor_by_hand():
    from pipeline.environment.simulated.terse import TOO_LONG_REPLY

    reply = "On dune wrote my notes give Frank Herbert. Isaac Asimov is listed under foundation wrote."
    ev = {"f1": {"a": [1.0, 0.0, 0.0, 0.5]}, "predictions": {"a": ["Frank Herbert", "isaac asimov.", "Tolkien",
                                                                    "Herbert"]},
          "replies": {"a": [[reply], [reply], [TOO_LONG_REPLY.format(words=12, limit=8)], [reply]]}}
    assert picks(ev) == {"gold": 1, "distractor": 1, "other": 1, "unanswered": 1}
    assert picks({"f1": {}, "predictions": {}}) is None  # written before replies were kept


def test_t_interval_over_seed_differences_by_hand():
    from learning_report import t_interval

    # mean 0, sample sd 50, n 3: half-width t(0.975, 2) * 50 / sqrt(3) = 4.3027 * 28.868 = 124.21
    assert t_interval([0.0, 50.0, -50.0]) == [-124.21, 124.21]
    # mean 3, sd sqrt(2), se 1, t(0.975, 1) = 12.706
    assert t_interval([2.0, 4.0]) == [-9.71, 15.71]
    assert t_interval([5.0]) is None


def _hops_eval(questions: list[str], f1: list[float], requests: list[list[str]]) -> dict:
    return {"f1": {"hops": f1}, "em": {"hops": f1}, "format": {"hops": [1.0] * len(f1)},
            "predictions": {"hops": ["an answer" if f else "" for f in f1]},
            "answered": {"hops": [1.0] * len(f1)}, "requests": {"hops": requests}, "questions": {"hops": questions},
            "f1_mean": sum(f1) / len(f1), "em_mean": sum(f1) / len(f1), "format_mean": 1.0,
            "answered_mean": 1.0, "examples": []}


def _rules(per_hop: dict[str, tuple[list[float], list[float]]]) -> dict:
    return {"mode": "hops", "trivial": [n for n in per_hop if n not in ("informed", "reask")],
            "references": ["informed", "reask"],
            "rules": {n: {"f1": {"1-hop": one, "2-hop": two}} for n, (one, two) in per_hop.items()}}


def test_hops_summary_pools_per_hop_and_the_seed_interval_by_hand(tmp_path):
    from learning_report import hops_summary

    from pipeline.environment.simulated.hops_world import split_questions, world

    _, heldout = split_questions(world().questions, 128)
    one, two_a, two_b = heldout[0], heldout[1], heldout[2]
    questions = [one.text, two_a.text, two_b.text]
    named = [[two_a.text, f"{two_a.relation} of {two_a.bridge}"]]  # names the bridge and the relation
    grpo_2hop = {1: [1.0, 0.0], 2: [1.0, 1.0], 3: [0.0, 0.0]}        # per seed 50, 100, 0 -> mean 50
    continued_2hop = {1: [0.0, 0.0], 2: [1.0, 0.0], 3: [0.0, 0.0]}   # 0, 50, 0 -> 16.67
    folder = tmp_path / "learning" / "hops"
    for seed in (1, 2, 3):
        run = folder / f"seed{seed}"
        write(run / "run.json", {"seed": seed, "grpo_steps_done": 2})
        write(run / "grpo_step0.json", _hops_eval(questions, [1.0, 0.0, 0.0], [[q] for q in questions]))
        write(run / "grpo_step2.json", _hops_eval(questions, [1.0, *grpo_2hop[seed]],
                                                  [[one.text], *named, [two_b.text]]))
        write(run / "warmup_continued.json", _hops_eval(questions, [0.5, *continued_2hop[seed]], [[]] * 3))
        write(run / "trivial_rules.json", _rules({"question": ([1.0], [0.0, 0.0]),
                                                  "ask_then_entity_3words": ([1.0], [0.5, 0.5]),
                                                  "informed": ([1.0], [1.0, 1.0]), "reask": ([1.0], [1.0, 0.0])}))
    write(folder / "seed1" / "transfer_grpo.json", _hops_eval(questions, [0.2, 0.4, 0.6], [[]] * 3))
    write(folder / "seed1" / "transfer_rules.json", _rules({"question": ([], [0.1]), "informed": ([], [0.9]),
                                                            "reask": ([], [0.7])}))
    summary = hops_summary(folder)
    assert summary["seeds"] == [1, 2, 3]
    assert summary["per_hop"] == {
        "1-hop": {"grpo": 100.0, "warmup": 100.0, "warmup_continued": 50.0, "question": 100.0,
                  "ask_then_entity_3words": 100.0},
        "2-hop": {"grpo": 50.0, "warmup": 0.0, "warmup_continued": 16.67, "question": 0.0,
                  "ask_then_entity_3words": 50.0}}
    assert summary["references"] == {"1-hop": {"informed": 100.0, "reask": 100.0},
                                     "2-hop": {"informed": 100.0, "reask": 50.0}}
    # best control on 2-hop: ask_then_entity_3words (50); per-seed differences 0, +50, -50
    assert summary["seed_interval_against"] == "ask_then_entity_3words"
    assert summary["seed_differences_2hop"] == [0.0, 50.0, -50.0]
    assert summary["seed_interval"] == {"2-hop": [-124.21, 124.21]}
    # beside it, the per-question bootstrap: per question, GRPO's mean over seeds (2/3, 1/3) against the
    # rule's (0.5, 0.5); the paired mean difference is 0
    boot = summary["bootstrap_2hop"]
    assert boot["grpo"]["mean"] == 50.0 and boot["ask_then_entity_3words"]["mean"] == 50.0
    assert boot["grpo_minus_best"]["mean"] == 0.0
    assert summary["requests"]["by_step"] == {"0": 0.0, "2": 0.5}
    assert summary["requests"]["seeds_by_step"] == {"0": 3, "2": 3}
    assert summary["requests"]["final"] == 0.5
    assert summary["controls"]["warmup_continued"] == {"kind": "agent", "1-hop": 50.0, "2-hop": 16.67}
    assert summary["transfer_popqa"]["grpo"] == 40.0 and summary["transfer_popqa"]["informed"] == 90.0


def test_hops2_summary_judges_the_goal_and_hypotheses_by_hand(tmp_path):
    """The hops2 block from three seeds' files: per-hop means over seeds, the per-seed 2-hop differences and
    their t-intervals, and H1-H3 with the goal, each computable by hand."""
    from hops2_report import hops2_summary

    from pipeline.environment.simulated.hops_world import split_questions, world

    _, heldout = split_questions(world().questions, 128)
    one, two_a, two_b = heldout[0], heldout[1], heldout[2]
    questions = [one.text, two_a.text, two_b.text]
    named = [[two_a.text, f"{two_a.relation} of {two_a.bridge}"], [two_b.text, f"{two_b.relation} of {two_b.bridge}"]]
    grpo = {1: [1.0, 1.0], 2: [1.0, 0.5], 3: [1.0, 1.0]}     # 2-hop per seed 100, 75, 100 -> 91.67
    folder = tmp_path / "hops2"
    for seed in (1, 2, 3):
        run = folder / f"seed{seed}"
        write(run / "task_grpo.json", {"steps_done": 10, "evaluated": "grpo_step10", "health_breach": None})
        write(run / "task_shuffled_advantage.json", {"steps_done": 10, "evaluated": "shuffled_advantage"})
        write(run / "grpo_step0.json", _hops_eval(questions, [1.0, 0.0, 0.5], [[q] for q in questions]))
        write(run / "grpo_step10.json", _hops_eval(questions, [0.5, *grpo[seed]], [[one.text], *named]))
        write(run / "shuffled_advantage.json", _hops_eval(questions, [1.0, 0.0, 0.5], [[q] for q in questions]))
        if seed < 3:  # a control two seeds have: pooled over those two
            write(run / "warmup_continued.json", _hops_eval(questions, [1.0, 1.0, 1.0], [[]] * 3))
        write(run / "trivial_rules.json", _rules({"question": ([1.0], [0.0, 0.0]), "informed": ([1.0], [1.0, 1.0]),
                                                  "reask": ([1.0], [1.0, 0.5])}))
    summary = hops2_summary(folder)
    assert summary["seeds"] == [1, 2, 3] and summary["complete"]
    assert summary["per_hop"]["2-hop"] == {"grpo": 91.67, "warmup": 25.0, "shuffled_advantage": 25.0,
                                           "warmup_continued": 100.0, "question": 0.0, "informed": 100.0,
                                           "reask": 75.0}
    assert summary["per_hop"]["1-hop"]["grpo"] == 50.0 and summary["seeds_per_system"]["warmup_continued"] == 2
    assert summary["seed_differences_2hop"]["grpo_minus_warmup"] == [75.0, 50.0, 75.0]
    assert summary["seed_differences_2hop"]["grpo_minus_warmup_continued"] == [0.0, -25.0]
    low, _high = summary["seed_interval"]["grpo_minus_warmup"]
    assert low == pytest.approx(66.67 - 4.303 * 14.434 / 3 ** 0.5, abs=0.05) and low > 0  # mean 66.67, sd 14.43
    assert summary["goal"]["met"] and summary["hypotheses"]["H1"]["verdict"]
    assert summary["hypotheses"]["H1"]["seeds_positive"] == 3 and summary["hypotheses"]["H2"]["verdict"]
    assert summary["hypotheses"]["H3"] == {"verdict": True, "second_requests_final": 1.0,
                                           "second_requests_step0": 0.0}
    # the mechanism figures: seed 1's GRPO answered both 2-hop questions after exactly two requests
    assert summary["per_seed"]["1"]["answering"]["grpo"]["answered_after_two_requests"] == 1.0
    assert summary["per_seed"]["1"]["answering"]["warmup"]["answered_after_two_requests"] == 0.0
    # the verdicts can be false: the same files with GRPO equal to the warm-up on seed 3
    write(folder / "seed3" / "grpo_step10.json", _hops_eval(questions, [1.0, 0.0, 0.5], [[q] for q in questions]))
    worse = hops2_summary(folder)
    assert worse["seed_differences_2hop"]["grpo_minus_shuffled_advantage"] == [75.0, 50.0, 0.0]
    assert not worse["hypotheses"]["H2"]["verdict"] and not worse["goal"]["met"]


def test_hops2_shuffled_advantages_permute_within_groups_and_keep_flat_groups_flat():
    """The shuffled-advantage control: each group's scores permuted among its members (the same multiset per
    group, so the same advantage sizes), flat groups unchanged, the same permutation for the same scores."""
    import torch
    from bench_hops2 import permuted_within_groups

    scores = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.2, 0.9, 0.1])
    groups = ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    out = permuted_within_groups(scores, groups, seed=1)
    for k in range(3):
        assert sorted(out[3 * k: 3 * k + 3].tolist()) == sorted(scores[3 * k: 3 * k + 3].tolist())
    assert out[3:6].tolist() == [0.5, 0.5, 0.5]
    assert torch.equal(out, permuted_within_groups(scores, groups, seed=1))
    moved = [not torch.equal(permuted_within_groups(scores, groups, seed=s), scores) for s in range(1, 9)]
    assert any(moved)  # it does permute


def test_hops2_early_stop_counts_groups_with_answer_variance(tmp_path):
    from bench_hops2 import answer_variance_groups

    lines = [{"step": 1, "uid": "q1", "reward": {"answer": 0.0}}, {"step": 1, "uid": "q1", "reward": {"answer": 0.0}},
             {"step": 2, "uid": "q2", "reward": {"answer": 1.0}}, {"step": 2, "uid": "q2", "reward": {"answer": 0.0}},
             {"step": 4, "uid": "q3", "reward": {"answer": 1.0}}, {"step": 4, "uid": "q3", "reward": {"answer": 0.0}}]
    path = tmp_path / "trajectories.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert answer_variance_groups(path, 3) == {1: 0, 2: 1, 3: 0}
