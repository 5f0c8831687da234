"""Training checkpoints → one verified Hugging Face model in `paths.model_dir`: the merge itself.

`merge_checkpoint(plan)` is what the `merge` stage runs (pipeline/stages/merge.py resolves the `MergePlan`,
pipeline.train.merge_plan, from params) and what `promptr1 doctor` merges its one-step verl checkpoint with.

Three sources, one output:
- backend `verl`: verl's own merger on the newest `global_step_N/actor` (FSDP shards), run as
  `python -m verl.model_merger merge --backend fsdp --local_dir … --target_dir …`;
- local LoRA: the adapter of the newest `step_N/` loaded onto the base model from params and merged into
  its weights (`merge_and_unload`);
- local full fine-tune: the newest `step_N/model` saved as is.

The output holds safetensors weights, config, generation config, the tokenizer *with its chat template*
(the agent's prompts are chat-formatted), `README.md` (Hugging Face model card with front matter) and
the same text as `MODEL_CARD.md`: base model, training data, params, final training metrics, git commit.

Verification before the output is published, failing loudly (`MergeVerificationError`):
- the merged model's logits on a fixed chat-formatted input match the trained checkpoint's (LoRA: the
  unmerged base + adapter; full fine-tune: the checkpoint weights) within a dtype-dependent tolerance.
  For verl there is no second copy to compare with here (FSDP shards load only through verl's merger),
  so the merger's output is checked to load and generate;
- the merged model generates at least one token with greedy decoding;
- the saved tokenizer reloads with a chat template.

Atomic output: everything is written into a hidden temporary folder beside `model_dir` and swapped in
only after verification, so `models/agent` is always either the previous model or a verified new one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.errors import UserError
from pipeline.modelref import load_causal_lm, load_tokenizer
from pipeline.stage_files import MERGE_REPORT_FILE, TRAIN_FILE
from pipeline.train import checkpoint as ckpt

if TYPE_CHECKING:
    from pipeline.train.merge_plan import MergePlan

log = logging.getLogger(__name__)


PROBE_MESSAGES = [{"role": "user", "content": "Question: Who wrote Hamlet?\nAnswer briefly."}]
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


class MergeVerificationError(RuntimeError):
    """The merged model does not reproduce the trained checkpoint, cannot generate, or lacks its template."""


@dataclass
class MergeReport:
    source: str
    """local-full | local-lora | verl"""
    checkpoint: str
    step: int | None
    max_abs_logit_diff: float
    generated_tokens: int
    sample: str


def verl_merge_command(actor_dir: Path, target_dir: Path) -> list[str]:
    """The verl merger invocation for an FSDP actor checkpoint."""
    return [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
            "--local_dir", str(actor_dir), "--target_dir", str(target_dir)]


def probe_input(tokenizer) -> dict[str, torch.Tensor]:
    text = tokenizer.apply_chat_template(PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}


@torch.no_grad()
def probe_logits(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in inputs.items()}).logits.float().cpu()


@torch.no_grad()
def greedy_sample(model, tokenizer, inputs: dict[str, torch.Tensor], max_new_tokens: int = 8) -> tuple[int, str]:
    device = next(model.parameters()).device
    out = model.generate(**{k: v.to(device) for k, v in inputs.items()}, max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out[0, inputs["input_ids"].shape[1]:]
    return int(new.numel()), tokenizer.decode(new, skip_special_tokens=True)


def _publish(tmp: Path, final: Path) -> None:
    """Swap a verified temporary folder into place (the old output removed only afterwards)."""
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _verify(merged_dir: Path, expected_logits: torch.Tensor | None, dtype: torch.dtype) -> tuple[float, int, str]:
    """Reload what was written, compare logits with the trained model's, check it generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(merged_dir), clean_up_tokenization_spaces=False)
    if not getattr(tokenizer, "chat_template", None):
        raise MergeVerificationError(f"{merged_dir}: the saved tokenizer has no chat template")
    model = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=dtype)
    inputs = probe_input(tokenizer)
    logits = probe_logits(model, inputs)
    diff = 0.0
    if expected_logits is not None:
        if logits.shape != expected_logits.shape:
            raise MergeVerificationError(f"merged logits shape {tuple(logits.shape)} != trained "
                                         f"{tuple(expected_logits.shape)}")
        diff = float((logits - expected_logits).abs().max())
        tol = TOLERANCE.get(dtype, 1e-3) * max(1.0, float(expected_logits.abs().max()) / 10)
        if not diff <= tol:
            raise MergeVerificationError(f"merged model's logits differ from the trained checkpoint's by "
                                         f"{diff:.3g} (tolerance {tol:.3g})")
    n_new, text = greedy_sample(model, tokenizer, inputs)
    if n_new < 1:
        raise MergeVerificationError("the merged model generated no token")
    return diff, n_new, text


def _relative(root: Path, path: Path) -> str:
    """The checkpoint path as stored in the model card/report: relative to the project, never a machine path."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return path.name


def _merge_local(plan: MergePlan, folder: Path, tmp: Path, dtype: torch.dtype) -> MergeReport:
    from transformers import AutoModelForCausalLM

    state = ckpt.TrainerState.read(folder)
    tok_dir = folder / "tokenizer"
    tokenizer = (load_tokenizer(str(tok_dir), plan.root) if tok_dir.is_dir()
                 else load_tokenizer(plan.agent.model, plan.root))
    inputs = probe_input(tokenizer)
    if (folder / "adapter").is_dir():
        from peft import PeftModel

        if state.base_model and state.base_model != plan.agent.model:
            log.warning("checkpoint was trained on %s; params name %s: merging onto the checkpoint's base",
                        state.base_model, plan.agent.model)
        base = load_causal_lm(state.base_model or plan.agent.model, plan.root, dtype)
        peft_model = PeftModel.from_pretrained(base, str(folder / "adapter"))
        expected = probe_logits(peft_model, inputs)
        merged = peft_model.merge_and_unload()
        source = "local-lora"
    elif (folder / "model").is_dir():
        merged = AutoModelForCausalLM.from_pretrained(str(folder / "model"), dtype=dtype)
        expected = probe_logits(merged, inputs)
        source = "local-full"
    else:
        raise UserError(f"{folder}: neither model/ nor adapter/ inside; the checkpoint is incomplete")
    merged.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    diff, n_new, text = _verify(tmp, expected, dtype)
    return MergeReport(source, _relative(plan.root, folder), state.step, diff, n_new, text)


def _merge_verl(plan: MergePlan, actor_dir: Path, tmp: Path, dtype: torch.dtype) -> MergeReport:
    cmd = verl_merge_command(actor_dir, tmp)
    log.info("running %s", " ".join(cmd))
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        raise MergeVerificationError(f"verl model merger failed ({result.returncode}): {result.stderr[-2000:]}")
    from transformers import AutoTokenizer

    # verl keeps the HF config and tokenizer under actor/huggingface; make sure the template travels.
    hf_dir = actor_dir / "huggingface"
    source_tok = hf_dir if hf_dir.is_dir() else None
    tokenizer = AutoTokenizer.from_pretrained(str(source_tok or tmp), clean_up_tokenization_spaces=False)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer = load_tokenizer(plan.agent.model, plan.root)
    tokenizer.save_pretrained(str(tmp))
    diff, n_new, text = _verify(tmp, None, dtype)
    step = actor_dir.parent.name.removeprefix("global_step_")
    return MergeReport("verl", _relative(plan.root, actor_dir), int(step) if step.isdigit() else None, diff, n_new,
                       text)


def _final_metrics(path: Path) -> dict[str, float]:
    import pandas as pd

    if not path.is_file():
        return {}
    frame = pd.read_csv(path)
    if frame.empty:
        return {}
    row = frame.iloc[-1].to_dict()
    keep = ("step", "critic/score/mean", "critic/score/max", "critic/score/min", "reward/format/mean",
            "reward/answer/mean", "actor/pg_loss", "actor/kl_loss", "response_length/mean", "num_turns/mean")
    out = {k: float(row[k]) for k in keep if k in row and pd.notna(row[k])}
    if "critic/score/mean" in frame:
        out["reward_curve"] = [round(float(v), 4) for v in frame["critic/score/mean"]]  # type: ignore[assignment]
    return out


def _data_summary(plan: MergePlan) -> dict[str, Any]:
    import hashlib

    path = plan.train_file
    if not path.is_file():
        return {"train_file": f"{plan.rl_dir}/{TRAIN_FILE}", "present": False}
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    info: dict[str, Any] = {"train_file": f"{plan.rl_dir}/{TRAIN_FILE}", "md5": md5}
    try:
        import pyarrow.parquet as pq

        info["rows"] = pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - the card is informative; a metadata read failure must not stop merge
        log.warning("could not read the row count of %s: %s", path, exc)
    return info


def model_card(plan: MergePlan, report: MergeReport) -> str:
    """The README.md / MODEL_CARD.md text."""
    from pipeline.tracking.runs import git_commit

    metrics = _final_metrics(plan.steps_csv)
    data = _data_summary(plan)
    t, a = plan.train, plan.agent
    method = "LoRA merged into the base" if report.source == "local-lora" else (
        "full fine-tune" if report.source == "local-full" else "verl FSDP checkpoint merged")
    lines = [
        "---",
        "library_name: transformers",
        f"base_model: {a.model}",
        "tags: [prompt-r1, grpo, agent]",
        "---",
        "",
        "# Prompt-R1 agent",
        "",
        "A small agent LLM trained with GRPO (Prompt-R1, arXiv 2511.01016) to write prompts for a larger",
        "environment LLM over several turns and then answer. Use it with the chat template shipped here.",
        "",
        "## Training",
        f"- Base model: `{a.model}` ({a.dtype})",
        f"- Backend: `{t.backend}` ({method}); checkpoint `{Path(report.checkpoint).name}`, step {report.step}",
        f"- Environment: `{plan.environment.model}` via {plan.environment.backend}",
        f"- Reward preset: `{plan.reward.preset}`",
        (f"- Data: `{data.get('train_file')}` (rows: {data.get('rows', '?')}, md5 {data.get('md5', '?')}); "
         f"datasets: {', '.join(plan.train_datasets)}"),
        f"- Git commit: `{git_commit(plan.root)}`",
        f"- Merged: {datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        "",
        "## Parameters",
        "```json",
        json.dumps({"train": t.model_dump(mode="json", exclude={"verl"} if t.backend == "local" else None),
                    "agent": a.model_dump(mode="json"), "reward": plan.reward.model_dump(mode="json")},
                   indent=2),
        "```",
        "",
        "## Final training metrics",
    ]
    if metrics:
        lines += [f"- `{k}`: {v}" for k, v in metrics.items()]
    else:
        lines.append("- (no steps.csv found)")
    lines += [
        "",
        "## Merge verification",
        f"- max |logit difference| merged vs trained on a fixed input: {report.max_abs_logit_diff:.3g}",
        f"- greedy sample ({report.generated_tokens} tokens): {report.sample!r}",
        "",
    ]
    return "\n".join(lines)


def merge_checkpoint(plan: MergePlan) -> MergeReport:
    """Merge the newest checkpoint into `plan.model_dir` (see module docstring); returns the report."""
    dtype = ckpt.DTYPES[plan.agent.dtype]
    root = plan.checkpoint_dir
    final = plan.model_dir
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    for stray in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stray, ignore_errors=True)
    tmp.mkdir()
    try:
        if plan.train.backend == "verl":
            actor = ckpt.latest_verl_step(root)
            if actor is None:
                raise UserError(f"no verl checkpoint (global_step_N/actor) under {root}; run `promptr1 train`")
            report = _merge_verl(plan, actor, tmp, dtype)
        else:
            folder = ckpt.latest_checkpoint(root)
            if folder is None:
                raise UserError(f"no checkpoint under {root}; run `promptr1 train` first")
            report = _merge_local(plan, folder, tmp, dtype)
        card = model_card(plan, report)
        (tmp / "README.md").write_text(card)
        (tmp / "MODEL_CARD.md").write_text(card)
        (tmp / MERGE_REPORT_FILE).write_text(json.dumps(report.__dict__, indent=2))
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("merged %s (%s, step %s) into %s; max logit diff %.3g; sample %r", report.checkpoint,
             report.source, report.step, _relative(plan.root, final), report.max_abs_logit_diff, report.sample)
    return report
