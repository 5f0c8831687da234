"""The authors' 128-row evaluation files: where they are, and their rows read back into our terms.

`spec.eval_file` names the file in `<mirror>/prompt-r1/eval/`; in Hub mode the same files are fetched once
from the authors' GitHub repository into `paths.cache_dir` (written atomically). Row ids are
`<dataset>-eval-<row index>`: the files are fixed, so the index is a stable id.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.agent.template import split_user_message
from pipeline.config.specs import SourcePaths
from pipeline.data.sources.generated import generated_files
from pipeline.data.sources.reading import read_mirror_file
from pipeline.data.sources.registry import DatasetSpec
from pipeline.errors import DataError
from pipeline.paths import display_path
from pipeline.types import EvalRow

EVAL_COLUMNS = ("prompt", "reward_model")
AUTHORS_EVAL_URL = "https://raw.githubusercontent.com/QwenQKing/Prompt-R1/main/dataset/eval_data/{file}"


def authors_eval_path(where: SourcePaths, spec: DatasetSpec) -> Path:
    """Local path of the authors' evaluation file (fetched into the cache once in Hub mode); for a generated
    dataset, its held-out file (`generated.generated_files`)."""
    if spec.generated is not None:
        return generated_files(where.cache_dir, spec)[1]
    if where.mirror is not None:
        return where.mirror / "prompt-r1" / "eval" / spec.eval_file
    target = where.cache_dir / "prompt-r1" / "eval" / spec.eval_file
    if not target.is_file():
        url = AUTHORS_EVAL_URL.format(file=spec.eval_file)
        try:
            import httpx

            response = httpx.get(url, timeout=60.0, follow_redirects=True)
            response.raise_for_status()
        except Exception as exc:  # noqa: BLE001
            raise DataError(
                f"{spec.name}: cannot fetch the authors' evaluation file {url} ({type(exc).__name__}); "
                "set paths.mirror to a folder holding prompt-r1/eval/"
            ) from None
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".part")
        tmp.write_bytes(response.content)
        tmp.replace(target)
    return target


def normalised_eval_row(row: EvalRow, spec: DatasetSpec) -> dict[str, Any]:
    """An evaluation row in the normalised schema of the sampled files (what `validate` checks)."""
    return {
        "id": row.id,
        "question": row.question,
        "answers": row.answers,
        "context": "",
        "task_type": spec.task_type,
        "source_split": "eval",
        "dataset": spec.name,
    }


def load_authors_eval(where: SourcePaths, spec: DatasetSpec) -> list[EvalRow]:
    """The authors' evaluation rows of `spec`; ids are `<dataset>-eval-<row index>` (files are fixed)."""
    path = authors_eval_path(where, spec)
    shown = display_path(path, where.root)
    rows = read_mirror_file(path, where.root, EVAL_COLUMNS)
    out: list[EvalRow] = []
    for i, row in enumerate(rows):
        prompt, reward = row["prompt"], row["reward_model"]
        try:
            content = prompt[0]["content"]
            question, has_instruction = split_user_message(content, spec.name)
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise DataError(
                f"{shown}: row {i}, column 'prompt': not a Prompt-R1 user message ({exc})"
            ) from None
        truth = reward.get("ground_truth") if isinstance(reward, Mapping) else None
        if not isinstance(truth, list):
            raise DataError(f"{shown}: row {i}, column 'reward_model': no ground_truth list")
        out.append(
            EvalRow(
                dataset=spec.name,
                split="id" if spec.trains else "ood",
                index=i,
                id=f"{spec.name}-eval-{i:03d}",
                question=question,
                answers=list(truth),
                messages=[{"role": "user", "content": content}],  # split_user_message parsed it as one
                has_instruction=has_instruction,
            )
        )
    return out
