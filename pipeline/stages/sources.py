"""Stage `sources`: a fingerprint of every external input the data stages read, as small JSON files.

Why a stage of its own: the raw sources live outside the project (a local mirror anywhere on disk, or
the Hugging Face Hub), and where they live is decided by params merged in `pipeline.config` (a profile,
`-S paths.mirror=...`), which DVC's `${...}` templating never sees. Listing `${paths.mirror}/raw` as a
DVC dependency therefore breaks as soon as the mirror is empty (the Hub: the dep becomes `/raw`) or set
only in a profile (DVC still demands params.yaml's folder). The idiomatic DVC answer for external or
remote inputs is an `always_changed` stage that writes a fingerprint of them into the workspace; the
stages reading the sources depend on that fingerprint. DVC compares hashes, so an unchanged
fingerprint keeps every downstream stage skipped, and a changed source reruns exactly the stages
reading it, whatever profile chose the source.

What is written (`data/sources/`, one file per registry dataset plus one for the evaluation files):
- `<dataset>.json`: with a mirror, the md5 and size of each `raw/` file `sample` reads for the dataset
  and of the authors' evaluation file (`prompt-r1/eval/...`); with the Hub, the dataset id, config,
  split and the resolved revision (`HfApi().dataset_info(...).sha`), and the authors' evaluation file URL.
- A generated dataset (`hops`): its generator's version and the md5 of the rows it generates.
- `eval.json`: the evaluation-file fingerprints of every dataset. Every `sample@<dataset>` reads all
  of them (leakage check), and `validate`/`build` read them too; this one file is their dependency, so a
  changed raw file of one dataset reruns only that dataset's `sample`.

Design decisions:
- Never fails on a missing or unreachable source: a mirror file that is missing is recorded as such, a
  Hub that cannot be reached records the revision `"unreachable"` (logged). The stage that reads the
  source reports the real error; this stage only has to change its output when the source changes.
- Deterministic bytes (sorted keys, no timestamps, no absolute paths): the same sources give the same
  files, so DVC sees unchanged hashes and skips `sample`. Files are rewritten only when their content
  differs (DVC removes a non-persistent output before running, so in a `dvc repro` they are always
  written, byte-identical).
- The mirror's files are hashed with their content (md5, DVC's own hash); a small stat-keyed cache in
  `paths.cache_dir` (size, mtime, inode) skips rereading unchanged large files, as DVC's state does.
  The 17 MB test mirror hashes in well under a second either way.
- Hub look-ups for the same repository are made once and in parallel, with a short timeout, so an
  offline machine spends at most one timeout here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.config import Params
from pipeline.config.specs import source_paths
from pipeline.data.sources import AUTHORS_EVAL_URL, REGISTRY, DatasetSpec, SourcePaths
from pipeline.paths import display_path
from pipeline.stage_files import SOURCES_DIR, SOURCES_EVAL_FILE

log = logging.getLogger(__name__)

UNREACHABLE = "unreachable"
HUB_TIMEOUT_S = 10.0
_HASH_CACHE = "sources_md5.json"


def sources_dir(root: Path) -> Path:
    return root / SOURCES_DIR


class _Md5Cache:
    """md5 of files keyed by (resolved path, size, mtime_ns, inode); persisted as JSON in the cache dir."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        if path is not None and path.is_file():
            try:
                self.entries = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                self.entries = {}

    def md5(self, file: Path) -> str:
        real = file.resolve()
        st = real.stat()
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.entries.get(str(real))
        if hit and hit.get("stat") == key:
            return str(hit["md5"])
        digest = hashlib.md5(usedforsecurity=False)  # a content fingerprint (DVC's hash)
        with real.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        self.entries[str(real)] = {"stat": key, "md5": digest.hexdigest()}
        self.dirty = True
        return digest.hexdigest()

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".part")
            tmp.write_text(json.dumps(self.entries, sort_keys=True), encoding="utf-8")
            tmp.replace(self.path)
        except OSError as exc:  # a cache only: never fail the stage for it
            log.debug("md5 cache not saved (%s)", exc)


def _file_entry(mirror: Path, rel: str, cache: _Md5Cache) -> dict[str, Any]:
    """{file, md5, size} of `<mirror>/<rel>`, or {file, missing: true} when it is not a readable file."""
    path = mirror / rel
    try:
        return {"file": rel, "md5": cache.md5(path), "size": path.stat().st_size}
    except OSError:
        return {"file": rel, "missing": True}


def _hub_revisions(repos: list[str], timeout_s: float = HUB_TIMEOUT_S) -> dict[str, str]:
    """repo id → the Hub's current commit sha of the dataset repo, or "unreachable" (never raises)."""

    def one(repo: str) -> str:
        try:
            from huggingface_hub import HfApi

            sha = HfApi().dataset_info(repo, timeout=timeout_s).sha
        except Exception as exc:  # noqa: BLE001 — offline, DNS, timeout, 401/404: all "cannot tell"
            log.warning("%s: Hub revision unknown (%s: %s)", repo, type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "")
            return UNREACHABLE
        return sha or UNREACHABLE

    if not repos:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(repos))) as pool:
        return dict(zip(repos, pool.map(one, repos), strict=True))


def _eval_entry(mirror: Path | None, spec: DatasetSpec, cache: _Md5Cache) -> dict[str, Any]:
    if mirror is not None:
        return _file_entry(mirror, f"prompt-r1/eval/{spec.eval_file}", cache)
    # Hub mode: `sample` fetches the authors' fixed file from this URL (once, into paths.cache_dir).
    return {"file": spec.eval_file, "url": AUTHORS_EVAL_URL.format(file=spec.eval_file)}


def fingerprints(where: SourcePaths) -> dict[str, dict[str, Any]]:
    """File name (`<dataset>.json`, `eval.json`) → its content, for every registry dataset."""
    mirror = where.mirror
    cache = _Md5Cache(where.cache_dir / _HASH_CACHE)
    revisions = {} if mirror is not None else _hub_revisions(
        sorted({s.hub.path for s in REGISTRY.values() if s.hub is not None}))
    out: dict[str, dict[str, Any]] = {}
    evals: dict[str, Any] = {}
    for spec in REGISTRY.values():
        entry: dict[str, Any] = {"dataset": spec.name}
        if spec.generated is not None:  # made by code: its version and the md5 of its rows (no file to hash)
            rows = json.dumps(spec.generated.rows(), sort_keys=True, ensure_ascii=False).encode("utf-8")
            entry["source"] = "generated"
            entry["generated"] = entry["eval"] = evals[spec.name] = {
                "version": spec.generated.version, "rows_md5": hashlib.md5(rows, usedforsecurity=False).hexdigest()}
            out[f"{spec.name}.json"] = entry
            continue
        if mirror is not None:
            entry["source"] = "mirror"
            entry["raw"] = [_file_entry(mirror, f"raw/{rel}", cache) for rel in spec.mirror.files]
        else:
            hub = spec.hub
            entry["source"] = "hub"
            entry["hub"] = {"id": hub.path, "config": hub.config, "split": hub.split,
                            "revision": revisions[hub.path]}
        entry["eval"] = evals[spec.name] = _eval_entry(mirror, spec, cache)
        out[f"{spec.name}.json"] = entry
    out[SOURCES_EVAL_FILE] = {"source": "mirror" if mirror is not None else "hub", "eval": evals}
    cache.save()
    return out


def _dump(content: dict[str, Any]) -> bytes:
    return (json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def run_sources(params: Params, out_dir: Path | None = None) -> dict[str, bool]:
    """Write the fingerprints into `out_dir` (default `data/sources/`); return file name → rewritten?"""
    where = source_paths(params)
    target = out_dir if out_dir is not None else sources_dir(where.root)
    target.mkdir(parents=True, exist_ok=True)
    written: dict[str, bool] = {}
    for name, content in fingerprints(where).items():
        path, data = target / name, _dump(content)
        if path.is_file() and path.read_bytes() == data:
            written[name] = False
            continue
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        written[name] = True
    shown = display_path(where.mirror, where.root) if where.mirror is not None else "the Hugging Face Hub"
    log.debug("source fingerprints of %d datasets (%s) in %s; %d changed", len(written) - 1, shown,
             display_path(target, where.root), sum(written.values()))
    return written
