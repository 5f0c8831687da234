"""The wheel set that lets benchmarks/gpu_actor_check.py run on a GPU machine without network access.

The machine (the GPU check machine's image: `TARGET`, `BOX_PACKAGES`) has Python 3.12, torch 2.11.0,
transformers 5.17.0, tokenizers 0.23.2, peft and the scientific stack, and receives the repository plus at most
64 MiB of other files. What the check needs beyond it is listed, with versions, in
benchmarks/gpu_actor_check.requirements.txt; `scripts/gpu-check-wheels.sh` downloads those wheels for that machine
(cp312, manylinux x86_64), builds the one pure-Python package the registry has no wheel of, adds the Ray stand-in
and calls this module:

- `standin DEST`: the Ray stand-in (benchmarks/gpu_check_ray/ray, see its docstring) as a wheel `ray-2.60.0+standin`,
  built byte for byte the same from the same sources (fixed timestamps), so its sha256 is part of the manifest.
  verl's `import ray` (verl/protocol.py and five more modules) is all the check's path needs of Ray; Ray's own
  wheel (~75 MiB) does not fit in what may travel.
- `manifest DEST`: `DEST/MANIFEST.json` (each wheel's name, version, tags, bytes, sha256; the total; the target),
  and the set's problems, exit 1 when there are any: a pin of the requirements file without its wheel, a wheel the
  file does not pin, two versions of one package, a total above `LIMIT_MIB`.
- `closure DEST`: every requirement the set's wheels declare for the target (markers evaluated for Python 3.12 on
  Linux x86_64), met by the set, by the machine's packages (a version checked where it is known), or deliberately
  left out (`LEFT_OUT`, with why); what is met by nothing is a problem.
- `dry-run`: the committed record benchmarks/results/gpu_actor_check_dry_run.json: the manifest, the closure, pip's
  offline resolution of the set for the target (`pip install --dry-run --target … --no-index --find-links DEST
  --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --no-deps`: every pin found, every
  wheel installable there; `--no-deps`, since the machine's own packages are not wheels here, so the declared
  requirements are judged by `closure`), and a CPU run of the check in a fresh Python 3.11 venv holding the
  machine's package versions where they exist for it, plus the same pins built for cp311 (`differences` lists
  what is not the machine's).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import re
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "benchmarks" / "gpu_actor_check.requirements.txt"
STANDIN_SOURCE = ROOT / "benchmarks" / "gpu_check_ray"
STANDIN_NAME, STANDIN_VERSION = "ray", "2.60.0+standin"
LIMIT_MIB = 30.0
"""What the set may weigh: the repository and the set travel within 64 MiB, and the repository takes ~20 MiB."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
"""The machine's platform tags, newest first: pip matches `--platform` exactly, so older manylinux builds (orjson,
pydantic_core, tokenizers: manylinux_2_17) need their own (scripts/gpu-check-wheels.sh passes the same)."""
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation": "cp",
          "platform": "manylinux_2_28_x86_64", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
          "platform_python_implementation": "CPython"}
BOX_PACKAGES: dict[str, str | None] = {
    **dict.fromkeys([
        "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc",
        "anyio", "attrs", "certifi", "charset-normalizer", "click", "cloudpickle", "filelock", "frozenlist",
        "fsspec", "grpcio", "h11", "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna", "jinja2",
        "markdown", "markdown-it-py", "markupsafe", "mdurl", "ml-dtypes", "mpmath", "msgpack", "multidict",
        "networkx", "numpy", "packaging", "pandas", "peft", "pillow", "pip", "prometheus-client", "propcache",
        "protobuf", "psutil", "pyarrow", "pybind11", "pygments", "python-dateutil", "pyyaml", "regex",
        "requests", "rich", "safetensors", "scipy", "sentencepiece", "setuptools", "shellingham", "six",
        "sympy", "tensorboard", "tensorboard-data-server", "tiktoken", "tokenizers", "torch", "tqdm",
        "transformers", "triton", "typer", "typing-extensions", "typing-inspect", "urllib3", "uvloop",
        "werkzeug", "wheel", "wrapt", "xxhash", "yarl", "zipp"
    ]),
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
    "transformers": "5.17.0", "triton": "3.6.0",
}
"""The GPU check machine's Python packages (its image's list, 2026-11-17) with the versions its `pip list` showed
(None: present, version not read). The set carries transformers and tokenizers again at verl's versions: verl 0.9.1
needs transformers < 5.11, which needs tokenizers <= 0.23.0; installed to a folder put first on PYTHONPATH, they
shadow the machine's."""
SUBSTITUTED = {
    STANDIN_NAME: f"the stand-in {STANDIN_NAME}-{STANDIN_VERSION} (benchmarks/gpu_check_ray): verl's modules import "
                  "Ray, the check starts none; verl's trainer, worker groups, rollout servers and checkpoint "
                  "engines need the real one",
}
"""Requirements the set meets with a stand-in, and what that leaves out."""
LEFT_OUT = {
    "wandb": "imported by verl's tracking only for trainer.logger 'wandb' (verl/utils/tracking.py); the check logs "
             "nothing",
}
"""Requirements the set's wheels declare that it does not carry, and why."""
_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<tags>[^-]+-[^-]+-[^-]+)\.whl$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Wheel:
    """One wheel of the set, as the manifest lists it."""

    file: str
    name: str
    version: str
    tags: str
    bytes: int
    sha256: str
    requires: tuple[str, ...]
    """Its METADATA's Requires-Dist lines."""


def read_wheel(path: Path) -> Wheel:
    """A wheel's name, version, tags, size, sha256 and declared requirements."""
    match = _WHEEL_NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path.name} is not a wheel file name")
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode("utf-8")
    requires = tuple(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:"))
    return Wheel(file=path.name, name=canonical(match["name"]), version=match["version"], tags=match["tags"],
                 bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest(), requires=requires)


def read_pins(path: Path = REQUIREMENTS) -> dict[str, str]:
    """`name==version` lines of a requirements file, by canonical name."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def wheels_in(folder: Path) -> list[Wheel]:
    return [read_wheel(p) for p in sorted(folder.glob("*.whl"))]


def set_problems(wheels: list[Wheel], pins: dict[str, str], limit_mib: float = LIMIT_MIB) -> list[str]:
    """Why the wheels are not the set the requirements file pins, plus the stand-in, within `limit_mib`."""
    problems = []
    expected = {**pins, STANDIN_NAME: STANDIN_VERSION}
    by_name: dict[str, list[str]] = {}
    for wheel in wheels:
        by_name.setdefault(wheel.name, []).append(wheel.version)
    for name, version in expected.items():
        found = by_name.get(name, [])
        if found != [version]:
            problems.append(f"{name}=={version}: the set holds {found or 'no wheel of it'}")
    problems += [f"{name} {versions}: not pinned by {REQUIREMENTS.name}" for name, versions in by_name.items()
                 if name not in expected]
    total = sum(w.bytes for w in wheels) / 2**20
    if total > limit_mib:
        problems.append(f"the set weighs {total:.1f} MiB, above its {limit_mib:g} MiB")
    return problems


def manifest(folder: Path, python_version: str = TARGET["python_version"]) -> dict[str, Any]:
    """What `DEST/MANIFEST.json` holds (module docstring), for a set built for `python_version`."""
    wheels = wheels_in(folder)
    total = sum(w.bytes for w in wheels)
    listed = [{k: v for k, v in asdict(w).items() if k != "requires"} for w in wheels]
    target = {**TARGET, "python_version": python_version}
    return {"target": target, "requirements": str(REQUIREMENTS.relative_to(ROOT)), "wheels": listed,
            "total_bytes": total, "total_mib": round(total / 2**20, 2), "limit_mib": LIMIT_MIB,
            "problems": set_problems(wheels, read_pins())}


# ------------------------------------------------------------------------------------------- the stand-in
def build_standin(dest: Path) -> Path:
    """The Ray stand-in as a wheel in `dest`, the same bytes from the same sources (module docstring)."""
    dist = f"{STANDIN_NAME}-{STANDIN_VERSION}.dist-info"
    files = {str(p.relative_to(STANDIN_SOURCE)): p.read_bytes()
             for p in sorted(STANDIN_SOURCE.rglob("*.py")) if "__pycache__" not in p.parts}
    files[f"{dist}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {STANDIN_NAME}\nVersion: {STANDIN_VERSION}\n"
        "Summary: A stand-in for Ray's import surface, for benchmarks/gpu_actor_check.py only\n"
        "Provides-Extra: default\n").encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: gpu_check_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{name},sha256={_digest(data)},{len(data)}" for name, data in files.items()]
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, data, zipfile.ZIP_DEFLATED)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{STANDIN_NAME}-{STANDIN_VERSION}-py3-none-any.whl"
    path.write_bytes(buffer.getvalue())
    return path


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


# ------------------------------------------------------------------------------------------- the closure
def closure(wheels: list[Wheel], box: dict[str, str | None] = BOX_PACKAGES) -> dict[str, Any]:
    """Each requirement the wheels declare for `TARGET` (extras not asked for skipped), and what meets it."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    carried = {w.name: w.version for w in wheels}
    out: dict[str, Any] = {"from_set": [], "substituted": {}, "from_box": [], "from_box_version_unread": [],
                           "left_out": {}, "unsatisfied": []}
    for wheel in wheels:
        for text in wheel.requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({**TARGET, "extra": ""}):
                continue
            name, where = canonical(req.name), f"{req} (for {wheel.name})"
            version = carried.get(name) or box.get(name)
            if name in SUBSTITUTED and name in carried:
                out["substituted"][name] = f"{req} (for {wheel.name}): {SUBSTITUTED[name]}"
            elif name in carried:
                out["from_set" if Version(carried[name]) in req.specifier else "unsatisfied"].append(where)
            elif name in LEFT_OUT:
                out["left_out"][name] = LEFT_OUT[name]
            elif name in box and version is None:
                out["from_box_version_unread"].append(where)
            elif name in box:
                out["from_box" if Version(version) in req.specifier else "unsatisfied"].append(f"{where}: {version}")
            else:
                out["unsatisfied"].append(f"{where}: neither in the set nor on the machine")
    return {k: sorted(set(v)) if isinstance(v, list) else v for k, v in out.items()}


# ------------------------------------------------------------------------------------------- the dry run
def offline_resolution(folder: Path, scratch: Path) -> dict[str, Any]:
    """pip's offline resolution of the pins (and the stand-in) from `folder` alone, for `TARGET`."""
    report = scratch / "pip-report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--target",
               str(scratch / "target"), "--no-index", "--find-links", str(folder), "--only-binary=:all:",
               "--python-version", TARGET["python_version"], "--implementation", TARGET["implementation"],
               *(arg for tag in PLATFORMS for arg in ("--platform", tag)), "--no-deps", "--report", str(report),
               "-r", str(REQUIREMENTS), f"{STANDIN_NAME}=={STANDIN_VERSION}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    installed = []
    if report.is_file():
        installed = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}"
                           for i in json.loads(report.read_text())["install"])
    shown = [str(c).replace(str(folder), "<wheels>").replace(str(scratch), "<scratch>").replace(f"{ROOT}/", "")
             for c in command]
    return {"command": ["python", *shown[1:]], "returncode": done.returncode, "would_install": installed,
            "errors": done.stderr.strip().splitlines()[-5:] if done.returncode else []}


CPU_CHECK = ["--device", "cpu", "--tiny", "--prompt-tokens", "16", "--response-tokens", "24", "--lr", "1e-3"]
"""The CPU command benchmarks/README.md gives for benchmarks/gpu_actor_check.py (tests/test_gpu_actor_check.py)."""


def box_like_venv(venv: Path, torch_wheel: str) -> dict[str, Any]:
    """A fresh venv of the running Python (3.11 here) with the machine's packages the check's path imports, at
    the machine's versions where it has them (`BOX_PACKAGES`) and they exist for this Python, the others at the
    newest pip picks; returns the venv's packages."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    wanted = [f"{name}=={version}" for name, version in BOX_PACKAGES.items()
              if version and name not in ("torch", "triton")]
    wanted += ["peft", "pandas", "pyarrow", "pyyaml", "packaging", "psutil", "requests", "aiohttp", "xxhash",
               "fsspec", "filelock", "tqdm", "regex", "jinja2", "cloudpickle", "msgpack", "tensorboard", "anyio",
               "pybind11", "annotated-doc", "click", "typer", "rich", "httpx"]
    for _ in range(len(wanted)):
        done = subprocess.run([python, "-m", "pip", "install", "-q", torch_wheel, *wanted], capture_output=True,
                              text=True, check=False)
        missing = re.search(r"No matching distribution found for (\S+)==", done.stderr)
        if done.returncode == 0 or missing is None:
            break
        wanted = [w if not w.startswith(f"{missing[1]}==") else missing[1] for w in wanted]  # not built for it
    if done.returncode:
        raise RuntimeError(f"the venv's packages did not install: {done.stderr[-2000:]}")
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                            check=True)
    return {canonical(p["name"]): p["version"] for p in json.loads(listed.stdout)}


def cpu_dry_run(wheels_cp311: Path, venv: Path, torch_wheel: str, out: Path) -> dict[str, Any]:
    """The check on the CPU in a fresh venv: the machine's packages (`box_like_venv`), then the set built for the
    venv's Python installed to a folder first on PYTHONPATH, as on the machine (`pip install --target`)."""
    import os

    packages = box_like_venv(venv, torch_wheel)
    site = venv.parent / "gpu-check-site"
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *map(str, sorted(wheels_cp311.glob("*.whl")))], check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("VIRTUAL_ENV", None)
    started = time.perf_counter()
    done = subprocess.run([python, str(ROOT / "benchmarks" / "gpu_actor_check.py"), *CPU_CHECK, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    report = json.loads(out.read_text()) if out.is_file() else {}
    here = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    differences = [f"python: {here} here, {TARGET['python_full_version']} on the machine",
                   ("device: the CPU (the check's --device cpu: gloo, eager attention, the reference log-probs from "
                    "the actor before its update) here, one CUDA GPU (NCCL, sdpa, verl's reference worker) there")]
    differences += [f"{name}: {packages.get(name)} here, {version} on the machine"
                   for name, version in BOX_PACKAGES.items() if version and packages.get(name) != version]
    differences += [f"{w.file}: built for this Python, where the machine gets the cp312 build"
                    for w in wheels_in(wheels_cp311)
                    if w.tags not in ("py3-none-any", "py2.py3-none-any") and "-abi3-" not in w.tags]
    return {"python": here,
            "command": ["python", "benchmarks/gpu_actor_check.py", *CPU_CHECK, "--out", "<out>"],
            "returncode": done.returncode, "wall_s": round(time.perf_counter() - started, 1),
            "ok": bool(report.get("ok")), "versions": report.get("versions"),
            "update": report.get("update"), "compare_equal": report.get("compare", {}).get("equal"),
            "set_cp311": [w.file for w in wheels_in(wheels_cp311)], "venv_packages": packages,
            "differences": differences, "stderr_tail": done.stderr.strip().splitlines()[-8:] if done.returncode else []}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("standin", "manifest", "closure"):
        sub.add_parser(name).add_argument("dest", type=Path)
    sub.choices["manifest"].add_argument("--python-version", default=TARGET["python_version"])
    dry = sub.add_parser("dry-run")
    for flag in ("--wheels", "--wheels-cp311", "--scratch", "--out"):
        dry.add_argument(flag, type=Path, required=True)
    dry.add_argument("--torch-wheel", required=True, help="a CPU torch wheel for the venv's Python")
    args = parser.parse_args(argv)
    if args.command == "standin":
        print(build_standin(args.dest))
        return 0
    if args.command == "manifest":
        record = manifest(args.dest, args.python_version)
        (args.dest / "MANIFEST.json").write_text(json.dumps(record, indent=1) + "\n")
        print("\n".join(record["problems"]) or f"{len(record['wheels'])} wheels, {record['total_mib']} MiB")
        return 1 if record["problems"] else 0
    if args.command == "closure":
        found = closure(wheels_in(args.dest))
        print(json.dumps(found, indent=1))
        return 1 if found["unsatisfied"] else 0
    return dry_run(args)


def _shown(path: Path) -> str:
    """`path` as the record shows it: inside the repository relative to it, else by its name alone."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path.name


def dry_run(args: argparse.Namespace) -> int:
    """Write the committed record (module docstring); 1 when any part of it failed."""
    args.scratch.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "made_by": [f"scripts/gpu-check-wheels.sh {_shown(args.wheels)}",
                    f"scripts/gpu-check-wheels.sh {_shown(args.wheels_cp311)} 3.11",
                    (f"python benchmarks/gpu_check_wheels.py dry-run --wheels {_shown(args.wheels)} --wheels-cp311 "
                     f"{_shown(args.wheels_cp311)} --scratch <folder> --torch-wheel <a CPU torch wheel for the "
                     "venv's Python> --out benchmarks/results/gpu_actor_check_dry_run.json")],
        "date": time.strftime("%Y-%m-%d"),
        "manifest": manifest(args.wheels), "closure": closure(wheels_in(args.wheels)),
              "offline_resolution": offline_resolution(args.wheels, args.scratch),
              "cpu_dry_run": cpu_dry_run(args.wheels_cp311, args.scratch / "venv311", args.torch_wheel,
                                         args.scratch / "gpu_actor_check_cpu.json")}
    record["ok"] = (not record["manifest"]["problems"] and not record["closure"]["unsatisfied"]
                    and record["offline_resolution"]["returncode"] == 0 and record["cpu_dry_run"]["ok"])
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}: ok={record['ok']}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
