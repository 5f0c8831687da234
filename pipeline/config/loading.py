"""From files and overrides to a validated `Params`: profiles, `-S` overrides, output-path confinement.

`load_params` reads params.yaml, deep-merges the profile it names (`profiles/<name>.yaml`, itself merged
over the profile its `extends` key names, if any), then any overrides, validates, sets `root` and refuses output paths the pipeline must not own. `flatten` is the
dotted-key view MLflow logs (secrets are never in params, by construction).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.config.matrix import matrix_problems
from pipeline.config.sections import Params

PARAMS_FILE = "params.yaml"
PROFILES_DIR = "profiles"


class ConfigError(ValueError):
    """params.yaml or a profile is missing, malformed, or fails validation.

    `keys` are the dotted params keys refused (`train.lr`, `evaluate.environments`), when the refusal is about
    values rather than a file: what a caller that edited the params can put back (pipeline/refused_experiment.py).
    """

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys


_LEADING_KEY = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _problem_keys(problems: list[str]) -> tuple[str, ...]:
    """The dotted key each problem starts with (every problem names its key first), once each, in order."""
    keys = (m.group(0) for p in problems if (m := _LEADING_KEY.match(p)))
    return tuple(dict.fromkeys(keys))


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Return `base` with `override` merged in; nested dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: file not found") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def profile_values(params_file: Path, profile: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keys of `profiles/<profile>.yaml`, merged over those of the profile it `extends` (if any), so a
    variant repeats only what it changes and follows its base when the base changes."""
    profile_file = params_file.parent / PROFILES_DIR / f"{profile}.yaml"
    if not profile_file.is_file():
        raise ConfigError(f"{params_file}: profile {profile!r} has no file {profile_file}", keys=("profile",))
    if profile in seen:
        raise ConfigError(f"{profile_file}: `extends` loops ({' -> '.join([*seen, profile])})")
    values = _read_yaml(profile_file)
    base = values.pop("extends", None)
    if base is None:
        return values
    if not isinstance(base, str):
        raise ConfigError(f"{profile_file}: `extends` must name one profile, got {base!r}")
    return deep_merge(profile_values(params_file, base, (*seen, profile)), values)


def find_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` (default: cwd) holding params.yaml."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / PARAMS_FILE).is_file():
            return folder
    raise ConfigError(f"no {PARAMS_FILE} found in {here} or any parent folder")


def load_params(
    params_file: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Params:
    """Load params.yaml, merge the profile it names, then `overrides`; validate.

    Raises ConfigError naming the file and the dotted key of every invalid field.
    """
    path = Path(params_file) if params_file else find_root() / PARAMS_FILE
    path = path.resolve()
    raw = _read_yaml(path)
    profile = (overrides or {}).get("profile", raw.get("profile", "default"))
    if profile and profile != "default":
        raw = deep_merge(raw, profile_values(path, profile))
    if overrides:
        raw = deep_merge(raw, overrides)
    try:
        params = Params.model_validate(raw)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"{path} (profile {profile!r}): {'; '.join(problems)}",
                          keys=_problem_keys(problems)) from exc
    params.root = path.parent
    problems = output_path_problems(params) + matrix_problems(params)
    if problems:
        raise ConfigError(f"{path} (profile {profile!r}): " + "; ".join(problems), keys=_problem_keys(problems))
    return params


OUTPUT_PATH_KEYS = ("sampled_dir", "rl_dir", "reports_dir", "checkpoint_dir", "model_dir", "cache_dir", "gepa_dir")
"""`paths.*` the pipeline writes, replaces and deletes: each must be a folder of the project's own."""
PROTECTED_FOLDERS = frozenset({".git", ".dvc", "pipeline", "flows", "tests", "profiles", "benchmarks", "docs",
                               ".ci", "scripts", "constraints"})
"""Top-level folders of the project that hold code or history, never outputs."""


def output_path_problems(params: Params) -> list[str]:
    """Why each output path param is unsafe (empty = all safe).

    An output swap replaces and removes its folder, so an output path must never be the project root or a
    parent of it, one of the project's code folders, a relative path that climbs out of the project, or a
    top-level system folder (`/`, `/tmp`, `/home`, the home directory). An absolute path elsewhere is an
    explicit choice (tests write into temporary folders) and is allowed.
    """
    root = params.root.resolve()
    home = Path.home().resolve()
    problems = []
    for key in OUTPUT_PATH_KEYS:
        value = getattr(params.paths, key)
        target = (root / value).resolve()
        where = f"paths.{key}={value!r} resolves to {target}"
        # Both reasons are checked on their own, so the one given for `/tmp` or `..` does not depend on where
        # the project lies (a clone inside /tmp makes /tmp a parent of it too).
        reasons = [reason for reason, applies in (
            ("the project folder or a parent of it", target == root or target in root.parents),
            ("a top-level system folder", len(target.parts) < 3 or target == home)) if applies]
        if reasons:
            problems.append(f"{where}, {' and '.join(reasons)} (outputs are replaced and removed)")
        elif root in target.parents and target.relative_to(root).parts[0] in PROTECTED_FOLDERS:
            problems.append(f"{where}, inside the project's {target.relative_to(root).parts[0]}/ folder, "
                            "which holds code, not outputs")
        elif root not in target.parents and not Path(value).is_absolute():
            problems.append(f"{where}: a relative output path must stay inside the project folder")
    return problems


def parse_override(text: str) -> dict[str, Any]:
    """Turn `a.b.c=value` (value parsed as YAML) into a nested dict, as `dvc exp run -S` does."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value")
    key, value = text.split("=", 1)
    node: Any = yaml.safe_load(value) if value != "" else ""
    for part in reversed(key.strip().split(".")):
        node = {part: node}
    return node


def flatten_dict(data: dict[str, Any]) -> dict[str, Any]:
    """Nested dict → {"a.b.c": value}."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", data)
    return out


def flatten(params: Params) -> dict[str, Any]:
    """Dotted-key view of the params (for MLflow), secrets excluded by construction."""
    return flatten_dict(params.model_dump(mode="json"))
