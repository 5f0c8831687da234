"""dvc.yaml is complete: every module a stage's command imports is one of that stage's deps.

DVC reruns a stage only when a listed dep changes, so a module missing from the list makes `dvc repro` say
"up to date" for a result that would change. The truth is computed here, not written by hand: for each stage
`promptr1 <verb>`, the module that implements the verb is the one `pipeline/cli.py` imports lazily inside the
verb's command function; its import closure *inside this repository* (every `import`/`from … import`, also
those inside functions, plus the package `__init__.py` files Python runs on the way) must be covered by the
stage's deps, where a listed folder covers everything below it. A listed code dep that no longer exists fails too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from stage_code.closure import CODE_PACKAGES, ROOT, import_closure, stage_closure, stages, verb_modules


def covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(ROOT)
    return any(rel == Path(d) or Path(d) in rel.parents for d in deps)


STAGES = stages()


@pytest.mark.parametrize(("stage", "verb", "deps"), STAGES, ids=[s[0] for s in STAGES])
def test_stage_deps_cover_the_import_closure_of_its_verb(stage: str, verb: str, deps: list[str]) -> None:
    modules = verb_modules()
    assert verb in modules, (
        f"dvc.yaml stage {stage!r} runs `promptr1 {verb}`, which pipeline/cli.py does not define"
    )
    assert modules[verb], (
        f"`promptr1 {verb}` imports no pipeline module lazily: cannot tell its implementation"
    )
    closure = stage_closure(verb)
    missing = sorted(str(p.relative_to(ROOT)) for p in closure if not covered(p, deps))
    assert not missing, f"dvc.yaml stage {stage!r} misses deps its code imports: {missing}"


@pytest.mark.parametrize(("stage", "verb", "deps"), STAGES, ids=[s[0] for s in STAGES])
def test_stage_code_deps_exist(stage: str, verb: str, deps: list[str]) -> None:
    code = [d for d in deps if d.split("/")[0] in (*CODE_PACKAGES, "profiles")]
    gone = [d for d in code if not (ROOT / d).exists()]
    assert not gone, f"dvc.yaml stage {stage!r} lists deps that no longer exist: {gone}"


def test_closure_follows_lazy_imports_and_parent_packages(tmp_path: Path) -> None:
    """The checker itself: a lazy import inside a function and the package __init__ are both in the closure."""
    closure = {str(p.relative_to(ROOT)) for p in import_closure("pipeline.cli")}
    assert "pipeline/__init__.py" in closure
    assert "pipeline/config/loading.py" in closure  # top-level import of cli (through the package)
    assert "pipeline/commands/ask.py" in closure  # imported only inside `ask()`
    assert verb_modules()["sample"] == {"pipeline.stages.sample"}  # a written-out command's lazy import
    assert verb_modules()["register"] == {"pipeline.stages.register"}  # a `module:function` row


def test_a_missing_dep_is_reported() -> None:
    """The check can fail: drop one module from the train stage's deps and it is named."""
    _, verb, _ = next(s for s in STAGES if s[0] == "train")
    closure = set().union(*(import_closure(m) for m in verb_modules()[verb]))
    # Replace folder deps by their files, then drop the reward module: coverage must break exactly there.
    files = [str(p.relative_to(ROOT)) for p in closure]
    without = [f for f in files if f != "pipeline/reward.py"]
    missing = [str(p.relative_to(ROOT)) for p in closure if not covered(p, without)]
    assert missing == ["pipeline/reward.py"]
