"""Reward functions by data source, and custom reward functions loaded from a file.

Every reward function has the verl signature

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None)
        -> float | dict    # a dict has a "score" key plus extra metrics

`default_compute_score` dispatches on `data_source` to the built-in verifiers.
`load_reward_fn(path, name)` imports a user's function from a Python file, checking at start
(before any rollout) that the file exists, defines `name`, and that `name` accepts the four
arguments, so a typo fails in seconds with a message instead of after the first generation.
A `RewardFnSpec` names a function by (path, name) so that reward worker processes can import it
themselves; function objects from files loaded this way do not pickle.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlframe.rewards.instructions import instruction_score
from rlframe.rewards.verifiers import (
    arithmetic_score,
    countdown_score,
    exact_match,
    gsm8k_score,
    math_score,
    tool_arithmetic_score,
)

REQUIRED_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")

# data_source -> verifier(solution_str, ground_truth) -> float | dict
_BY_SOURCE: dict[str, Callable] = {
    "arithmetic": arithmetic_score,
    "exact_match": exact_match,
    "countdown": countdown_score,
    "series": arithmetic_score,  # the written series, exactly
    "tool_arithmetic": tool_arithmetic_score,
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "math": math_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "ifeval": instruction_score,
    "google/IFEval": instruction_score,
}


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float | dict:
    """Score one response with the built-in verifier of its data source."""
    fn = _BY_SOURCE.get(data_source)
    if fn is None:
        raise ValueError(
            f"no built-in reward for data_source {data_source!r} (known: {sorted(_BY_SOURCE)}); "
            "give a function of your own with reward.function_path (a .py file) and reward.function_name "
            "(default compute_score)"
        )
    return fn(solution_str, ground_truth)


def check_signature(fn: Callable, *, where: str) -> None:
    """ValueError unless `fn` can be called as fn(data_source, solution_str, ground_truth, extra_info)."""
    if not callable(fn):
        raise ValueError(f"{where} is a {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot read the signature of {where}: {exc}") from exc
    try:
        sig.bind("src", "text", "truth", None)
        sig.bind(data_source="src", solution_str="text", ground_truth="truth", extra_info=None)
    except TypeError as exc:
        raise ValueError(
            f"{where} has signature {sig}, but reward functions are called as "
            f"fn({', '.join(REQUIRED_PARAMS)}) (positionally or by keyword); "
            f"rename or add parameters to match ({exc})"
        ) from exc


def load_reward_fn(path: str | Path, name: str = "compute_score") -> Callable:
    """Import `name` from the Python file `path` and validate its signature."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(
            f"reward function file {str(file)!r} does not exist (or is not a file); "
            "fix reward.function_path (relative paths are resolved from the working directory)"
        )
    module_name = f"rlframe_custom_reward_{abs(hash(str(file.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ValueError(f"importing reward function file {str(file)!r} failed: {exc!r}") from exc
        sys.modules[module_name] = module
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(
            f"reward function file {str(file)!r} defines no {name!r}; functions there: {public}; "
            "fix reward.function_name"
        )
    fn = getattr(module, name)
    check_signature(fn, where=f"{name!r} in {str(file)!r}")
    return fn


@dataclass(frozen=True)
class RewardFnSpec:
    """A picklable reference to a reward function: a file + name, or the built-in default."""

    path: str | None = None
    name: str = "compute_score"

    def load(self) -> Callable:
        if self.path is None:
            return default_compute_score
        return load_reward_fn(self.path, self.name)
