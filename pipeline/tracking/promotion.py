"""The promotion rule of the `register` stage: when a new model version becomes the champion.

In its own module so the stage (pipeline/stages/register.py) stays readable.

Promotion rule (all numbers in points, the evaluation's headline metrics mode; `m` = `register.metric`):
- `m` must be one of the candidate's ID averages; this is checked before anything is logged or
  registered, so a typo fails without leaving a new model version behind.
- No champion yet: the new version becomes champion.
- Candidate and champion evaluated in different metrics modes (`reference` vs `ours`): never promoted
  (the numbers are not comparable); the reason says so. A different number of rows per dataset is still
  compared, with a note in the reasons.
- `ci_rule: confident` (default) uses the candidate's bootstrap CIs (at `evaluate.confidence`); the
  champion's stored *means* are the reference values:
  1. ID gain (superiority): the *lower* bound of the candidate's ID CI of `m` ≥ champion ID mean + `margin`.
  2. OOD guard (non-inferiority), for every OOD average the two share (EM, F1, SSim): the *lower* bound of
     the candidate's OOD CI ≥ champion OOD mean − `ood_tolerance`.
  Promote only if both hold. So a promotion needs evidence of a gain and evidence of no OOD loss beyond
  the tolerance; with few rows per dataset the CIs are wide and the champion stays (the honest outcome:
  a 4-row evaluation cannot show a 0.5-point gain).
- `ci_rule: point` compares means only: ID mean ≥ champion + margin, and every OOD mean ≥ champion −
  tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.errors import UserError
from pipeline.metrics import HEADLINE_METRICS
from pipeline.types import TRAINED

if TYPE_CHECKING:
    from pipeline.config import RegisterConfig

TAG_PREFIX = "eval."
"""Prefix of the version tags holding a model's evaluation averages (the next run's champion numbers)."""


@dataclass
class EvalAverages:
    """A model's ID/OOD averages (points) with CIs, as evaluate wrote them or as stored in version tags."""

    id: dict[str, dict[str, float]]
    """metric → {mean, low, high}"""
    ood: dict[str, dict[str, float]]
    mode: str = "ours"
    rows_per_dataset: int = 0

    @classmethod
    def from_metrics_json(cls, metrics: dict[str, Any], system: str = TRAINED) -> EvalAverages:
        try:
            averages = metrics["averages"][system]
        except KeyError as exc:
            raise UserError(f"metrics.json has no averages for {system!r}: rerun `promptr1 evaluate`") from exc
        return cls(id=dict(averages.get("id", {})), ood=dict(averages.get("ood", {})),
                   mode=str(metrics.get("mode", "ours")), rows_per_dataset=int(metrics.get("rows_per_dataset", 0)))

    def to_tags(self) -> dict[str, str]:
        tags = {f"{TAG_PREFIX}mode": self.mode, f"{TAG_PREFIX}rows_per_dataset": str(self.rows_per_dataset)}
        for split, per_metric in (("id", self.id), ("ood", self.ood)):
            for metric, ci in per_metric.items():
                for k in ("mean", "low", "high"):
                    tags[f"{TAG_PREFIX}{split}.{metric}.{k}"] = f"{ci[k]:.4f}"
        return tags

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> EvalAverages | None:
        out: dict[str, dict[str, dict[str, float]]] = {"id": {}, "ood": {}}
        for key, value in tags.items():
            parts = key.split(".")
            if len(parts) == 4 and parts[0] + "." == TAG_PREFIX and parts[1] in out:
                out[parts[1]].setdefault(parts[2], {})[parts[3]] = float(value)
        if not out["id"]:
            return None
        return cls(id=out["id"], ood=out["ood"], mode=tags.get(f"{TAG_PREFIX}mode", ""),
                   rows_per_dataset=int(tags.get(f"{TAG_PREFIX}rows_per_dataset", "0")))


@dataclass
class PromotionDecision:
    promote: bool
    reasons: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    """Each comparison made: name, candidate value used, threshold, passed."""

    @property
    def verdict(self) -> str:
        """What the tags, promotion.json and the description say: `promoted` or `kept`."""
        return "promoted" if self.promote else "kept"

    @property
    def reason(self) -> str:
        """The reasons as one sentence."""
        return "; ".join(self.reasons)


def check_metric(candidate: EvalAverages, metric: str) -> None:
    """Raise UserError unless `metric` (register.metric) is one of the candidate's ID averages."""
    if metric not in candidate.id:
        raise UserError(f"register.metric={metric!r} has no ID average in metrics.json "
                        f"(available: {', '.join(sorted(candidate.id)) or 'none'})")


def decide_promotion(candidate: EvalAverages, champion: EvalAverages | None, cfg: RegisterConfig) -> PromotionDecision:
    """Apply the promotion rule of the module docstring."""
    metric, confident = cfg.metric, cfg.ci_rule == "confident"
    check_metric(candidate, metric)
    if champion is None:
        return PromotionDecision(True, ["no current champion: the first version becomes champion"])
    if not champion.mode:
        return PromotionDecision(False, [("champion has no recorded metrics mode (eval.mode tag): not comparable, "
                                         "kept")])
    if candidate.mode != champion.mode:
        reason = (f"not comparable: champion was evaluated in metrics mode {champion.mode!r}, candidate in "
                  f"{candidate.mode!r}; re-evaluate with the same evaluate.metrics_mode to compare")
        return PromotionDecision(False, [reason])
    reasons: list[str] = []
    checks: list[dict[str, Any]] = []
    if candidate.rows_per_dataset != champion.rows_per_dataset:
        reasons.append(f"note: champion was evaluated with rows={champion.rows_per_dataset}; "
                       f"candidate with rows={candidate.rows_per_dataset}")
    if metric not in champion.id:
        return PromotionDecision(False, [*reasons, f"champion has no ID {metric} recorded: not comparable, kept"],
                                 checks)
    lacking = [m for m in HEADLINE_METRICS if m in champion.ood and m not in candidate.ood]
    if lacking:
        return PromotionDecision(False, [*reasons, (f"candidate has no OOD {', '.join(lacking)} while the champion "
                                         "has: the OOD guard cannot be checked, kept")], checks)

    bound = "low" if confident else "mean"
    cand_id = candidate.id[metric][bound]
    need = champion.id[metric]["mean"] + cfg.margin
    id_ok = cand_id >= need
    checks.append({"check": f"id.{metric}", "candidate_" + bound: cand_id, "threshold": round(need, 4),
                   "champion_mean": champion.id[metric]["mean"], "passed": id_ok})
    reasons.append(
        f"ID {metric}: candidate {bound} {cand_id:.2f} {'≥' if id_ok else '<'} champion {champion.id[metric]['mean']:.2f}"
        f" + margin {cfg.margin:g} = {need:.2f}"
    )
    ood_ok = True
    for m in HEADLINE_METRICS:
        if m not in candidate.ood or m not in champion.ood:
            continue
        value = candidate.ood[m][bound]
        floor = champion.ood[m]["mean"] - cfg.ood_tolerance
        ok = value >= floor
        ood_ok &= ok
        checks.append({"check": f"ood.{m}", "candidate_" + bound: value, "threshold": round(floor, 4),
                       "champion_mean": champion.ood[m]["mean"], "passed": ok})
        if not ok:
            reasons.append(f"OOD {m}: candidate {bound} {value:.2f} < champion {champion.ood[m]['mean']:.2f}"
                           f" − tolerance {cfg.ood_tolerance:g} = {floor:.2f}")
    if ood_ok:
        reasons.append(f"OOD: every candidate {bound} ≥ champion mean − {cfg.ood_tolerance:g}")
    return PromotionDecision(id_ok and ood_ok, reasons, checks)


def rival_scores(metrics: dict[str, Any], metric: str) -> dict[str, float]:
    """The ID mean of `metric` of every other system in metrics.json's averages (system → points)."""
    return {s: av["id"][metric]["mean"] for s, av in metrics.get("averages", {}).items()
            if s != TRAINED and metric in av.get("id", {})}


def register_sentence(model_name: str, version: str, decision: PromotionDecision, alias: str, after: str | None,
                      candidate: EvalAverages, metric: str, rivals: dict[str, float]) -> str:
    """The register run's description: the decision, the rule's real reason (e.g. "no current champion", not
    the CI rule that was never applied), the candidate's ID figure, and any other system of the same evaluation
    that scored higher on it (`rivals`: system → ID mean), since the rule compares agent versions, not systems."""
    ci = candidate.id[metric]
    line = (f"Registered {model_name} v{version}: {decision.verdict} ({alias} → v{after}) because "
            f"{decision.reason}. Candidate ID {metric} {ci['mean']:.2f} [{ci['low']:.2f}, "
            f"{ci['high']:.2f}]")
    better = sorted(((s, v) for s, v in rivals.items() if v > ci["mean"]), key=lambda sv: -sv[1])
    if better:
        line += ("; below " + ", ".join(f"{s} ({v:.2f})" for s, v in better)
                 + " in the same evaluation (the rule compares versions of the agent, not systems)")
    return line + f". Version: models:/{model_name}/{version}."
