"""The pinned pre-training gives the same bytes on two (emulated) machines that differ where real ones do.

A second machine is emulated by what differs between x86-64 machines and changes fp32 results:
ATen's kernel build (AVX512 vs AVX2, via ATEN_CPU_CAPABILITY as torch would pick it), MKL's code path
(an Intel CPU vs this one, via a tiny LD_PRELOAD library that answers MKL's vendor check with "Intel",
and MKL limited to AVX2) and the machine's default thread count. Without REPRODUCIBLE_ENV the two
machines train different weights (checked by the second test); with it the weights are identical.
"""

import hashlib
import json
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from rlframe.data import pretrain
from rlframe.data.pretrain import SFTConfig, build_pretrained_model

CFG = SFTConfig(steps=6, batch_size=32, num_train=200, num_test=20, warmup=2)


def _cpu_flags() -> set[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


FLAGS = _cpu_flags()
pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="the pinning is for x86-64 CPUs with AVX2")


def _intel_mkl_shim(tmp_path: Path) -> str | None:
    """A shared library that makes MKL's dispatcher take its Intel code path (None without a C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src, lib = tmp_path / "intel_mkl_shim.c", tmp_path / "libintel_mkl_shim.so"
    src.write_text("int mkl_serv_intel_cpu_true(void) { return 1; }\nint mkl_serv_intel_cpu(void) { return 1; }\n")
    proc = subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True)
    return str(lib) if proc.returncode == 0 else None


def _machines(tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(wide, narrow): an Intel-like AVX512 machine with 2 threads, an AVX2-only one with 1 thread."""
    wide = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    if "avx512f" in FLAGS:
        wide["ATEN_CPU_CAPABILITY"] = "avx512"
    shim = _intel_mkl_shim(tmp_path)
    if shim is not None:
        wide["LD_PRELOAD"] = shim
    narrow = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
              "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return wide, narrow


def _build_on(machine: dict[str, str], monkeypatch, cache: Path) -> tuple[str, dict]:
    """(sha256 of model.safetensors, rlframe_pretrain.json) of a build with `machine`'s environment."""
    with monkeypatch.context() as m:
        for k, v in machine.items():
            m.setenv(k, v)
        path = build_pretrained_model(preset="demo", seed=0, cfg=CFG, cache_dir=cache)
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    return digest, json.loads((path / "rlframe_pretrain.json").read_text())


def test_pinned_pretraining_is_bitwise_identical_across_emulated_machines(tmp_path, monkeypatch):
    wide, narrow = _machines(tmp_path)
    a, info_a = _build_on(wide, monkeypatch, tmp_path / "wide")
    b, info_b = _build_on(narrow, monkeypatch, tmp_path / "narrow")
    assert a == b
    assert info_a["weights_sha256"] == info_b["weights_sha256"] == a
    for info in (info_a, info_b):
        assert info["cpu_capability"] == "AVX2" and info["torch_threads"] == CFG.threads
        assert info["env"]["MKL_CBWR"] == "COMPATIBLE" and info["env"]["OMP_NUM_THREADS"] == str(CFG.threads)


def test_without_the_pinning_the_emulated_machines_differ(tmp_path, monkeypatch):
    """The control: the emulation is a real difference, so the test above could fail."""
    wide, narrow = _machines(tmp_path)
    if "ATEN_CPU_CAPABILITY" not in wide and "LD_PRELOAD" not in wide:
        pytest.skip("no AVX512 and no C compiler: this machine cannot emulate a second one")
    monkeypatch.setattr(pretrain, "REPRODUCIBLE_ENV", {})
    a, _ = _build_on(wide, monkeypatch, tmp_path / "wide")
    b, _ = _build_on(narrow, monkeypatch, tmp_path / "narrow")
    assert a != b
