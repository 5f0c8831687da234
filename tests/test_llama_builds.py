"""The llama.cpp builds the CPU install makes (scripts/install-llama-cpp.sh): the server the pipeline runs
(`xllamacpp`, pipeline/environment/llama_server.py) is compiled for this CPU like the bindings, from its
source archive, without AMX.

The registry's xllamacpp wheel is a portable AVX2 build; on a CPU with AVX-512 it leaves that unit idle in
every prefill and decode the pipeline runs (benchmarks/results/engines.json).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install-llama-cpp.sh"


def _features(system_info: str) -> set[str]:
    """The CPU features a llama.cpp build reports as on (`AVX512 = 1 | ...`)."""
    return {name for name, on in re.findall(r"(\w+) = (\d)", system_info) if on == "1"}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_the_script_builds_the_server_from_source_for_this_cpu_without_amx():
    text = SCRIPT.read_text()
    command = text[text.index("XLLAMACPP=") :]
    assert "--no-binary xllamacpp" in command and "--force-reinstall" in command
    assert "-DGGML_NATIVE=ON" in command
    for flag in ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"):
        assert flag in text
    for off in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16", "LLAMA_CURL", "LLAMA_BUILD_BORINGSSL"):
        assert f"-D{off}=OFF" in command
    pin = re.search(r'"xllamacpp==([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert pin, "pyproject.toml pins xllamacpp: the script builds that version"


def test_the_installed_server_uses_the_vector_units_the_bindings_use():
    """Both llama.cpp builds in this environment report the same CPU features: the server was compiled
    here as the bindings were (native), not taken from the registry's AVX2 wheel."""
    llama_cpp = pytest.importorskip("llama_cpp")
    xllamacpp = pytest.importorskip("xllamacpp")
    bindings = _features(llama_cpp.llama_print_system_info().decode())
    server = _features(xllamacpp.get_system_info())
    simd = {f for f in bindings | server if f.startswith(("AVX", "F16C", "FMA", "AMX"))}
    assert {f for f in server if f in simd} == {f for f in bindings if f in simd}, (server, bindings)
    assert not any(f.startswith("AMX") for f in server)
    if "avx512f" in _cpu_flags():
        assert "AVX512" in server, xllamacpp.get_system_info()
