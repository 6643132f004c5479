"""The pinned pre-training gives the same bytes on two (emulated) machines that differ where real ones do.

A second machine is emulated by what differs between x86-64 machines and changes fp32 results:
ATen's kernel build (AVX512 vs AVX2, via ATEN_CPU_CAPABILITY as torch would pick it), MKL's code path
(an Intel CPU vs this one, via a tiny LD_PRELOAD library that answers MKL's vendor check with "Intel",
and MKL limited to AVX2) and the machine's default thread count. Without REPRODUCIBLE_ENV the two
machines train different weights (checked by the second test); with it the weights are identical.
"""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from rlframe.data.pretrain import SFTConfig

CFG = SFTConfig(steps=6, batch_size=32, num_train=200, num_test=20, warmup=2)
REPO = Path(__file__).resolve().parents[2]


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


# build_pretrained_model as a test here would call it, in a Python process of its own; argv: the SFTConfig
# (json), the cache directory, "pinned" or "unpinned" (REPRODUCIBLE_ENV emptied first: no pinning)
_BUILD = """
import json, sys
from rlframe.data import pretrain
if sys.argv[3] == "unpinned":
    pretrain.REPRODUCIBLE_ENV = {}
cfg = pretrain.SFTConfig(**json.loads(sys.argv[1]))
print(pretrain.build_pretrained_model(preset="demo", seed=0, cfg=cfg, cache_dir=sys.argv[2]))
"""


def _build_on(machines: list[dict[str, str]], caches: list[Path], *, pinned: bool = True) -> list[tuple[str, dict]]:
    """(sha256 of model.safetensors, rlframe_pretrain.json) of a build with each machine's environment.

    The builds run at the same time, each calling build_pretrained_model in a Python process of its own whose
    environment is this one's with the machine's variables set (what setting them here would hand to the
    pre-training child, which starts from it); `pinned=False` empties REPRODUCIBLE_ENV there first."""
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, json.dumps(asdict(CFG)), str(cache),
                               "pinned" if pinned else "unpinned"], cwd=REPO, env={**os.environ, **machine},
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for machine, cache in zip(machines, caches)]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        path = Path(out.strip().splitlines()[-1])
        digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
        results.append((digest, json.loads((path / "rlframe_pretrain.json").read_text())))
    return results


def test_pinned_pretraining_is_bitwise_identical_across_emulated_machines(tmp_path):
    wide, narrow = _machines(tmp_path)
    (a, info_a), (b, info_b) = _build_on([wide, narrow], [tmp_path / "wide", tmp_path / "narrow"])
    assert a == b
    assert info_a["weights_sha256"] == info_b["weights_sha256"] == a
    for info in (info_a, info_b):
        assert info["cpu_capability"] == "AVX2" and info["torch_threads"] == CFG.threads
        assert info["env"]["MKL_CBWR"] == "COMPATIBLE" and info["env"]["OMP_NUM_THREADS"] == str(CFG.threads)


def test_without_the_pinning_the_emulated_machines_differ(tmp_path):
    """The control: the emulation is a real difference, so the test above could fail."""
    wide, narrow = _machines(tmp_path)
    if "ATEN_CPU_CAPABILITY" not in wide and "LD_PRELOAD" not in wide:
        pytest.skip("no AVX512 and no C compiler: this machine cannot emulate a second one")
    (a, _), (b, _) = _build_on([wide, narrow], [tmp_path / "wide", tmp_path / "narrow"], pinned=False)
    assert a != b
