"""RewardManager: decoded responses -> scores (B,), computed in parallel, robust to bad samples.

Dataflow: the driver (or reward worker) passes B decoded response strings with their
`data_source`, `ground_truth` and `extra_info`; the manager splits the batch into contiguous chunks,
scores the chunks in a process pool (or inline when `num_workers=0`), and returns
`RewardResult(scores (B,) float32, extras {name: (B,)}, metrics, texts {name: (B,) strings})`. `token_level_scores` then
puts each score on the last valid response token, giving the (B, R) tensor of docs/contracts.md.

A reward function that raises, returns a non-number, or returns NaN/inf for one sample scores that
sample 0 and adds 1 to `reward/errors`; the first `max_logged_errors` tracebacks are logged.
A worker process that dies or a batch that exceeds `timeout_s` marks the samples of the chunks not
finished by then the same way and the pool is rebuilt. (Inline scoring has no timeout; math-verify
applies its own 5 s limit when it runs in a main thread.) A bug in one sample does not stop the
run, but a reward that fails on most of a batch does: when more than `max_error_fraction` of a
batch's samples fail (`reward.max_error_fraction`, default 0.5), `compute` raises
`RewardErrorsExceeded` with the first traceback, since training on those zeros teaches nothing.

Why a pool is optional: on a 2-core machine a cheap rule reward (~10 us/sample) costs far less
than shipping the strings to another process, so the default is inline; math-verify (sympy, ~ms
per sample) or user rewards that call out to slow code benefit from workers. See
benchmarks/bench_reward_manager.py and docs/benchmarks.md ("Reward manager") for the numbers.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np

from rlframe.rewards.registry import RewardFnSpec

logger = logging.getLogger("rlframe.rewards")

# Inline scoring: measured faster than a pool for rule rewards on the 2-core machine.
DEFAULT_NUM_WORKERS = 0

# One sample's outcome: (score, extra values (floats, and strings), traceback text or None).
Outcome = tuple[float, dict, "str | None"]

_WORKER_FNS: dict[RewardFnSpec, object] = {}


def _score_one(fn, data_source, solution_str, ground_truth, extra_info) -> Outcome:
    """Call the reward fn on one sample; any failure becomes (0.0, {}, traceback)."""
    try:
        out = fn(data_source, solution_str, ground_truth, extra_info)
        extras = {}
        if isinstance(out, dict):
            if "score" not in out:
                raise ValueError(f"reward function returned a dict without a 'score' key: {sorted(out)}")
            # booleans count as 0/1; strings are kept per sample (the generation dumps' score_parts), not
            # metrics; other values (lists, None, ...) are dropped
            extras = {k: v if isinstance(v, str) else float(v) for k, v in out.items()
                      if k != "score" and (_is_number(v) or isinstance(v, (bool, str)))}
            out = out["score"]
        if isinstance(out, bool) or not _is_number(out):
            raise TypeError(f"reward function returned {type(out).__name__} {out!r}; expected a float or a dict")
        score = float(out)
        if not math.isfinite(score):
            raise ValueError(f"reward function returned a non-finite score {score}")
        return score, extras, None
    except Exception:  # noqa: BLE001 - any user-code failure is scored 0 and reported, by design
        return 0.0, {}, traceback.format_exc()


def _number_or_nan(v) -> float:
    return np.nan if v is None or isinstance(v, str) else v


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def score_chunk(spec: RewardFnSpec, items: list[tuple]) -> list[Outcome]:
    """Score a list of (data_source, solution_str, ground_truth, extra_info); runs in a worker."""
    fn = _WORKER_FNS.get(spec)
    if fn is None:
        fn = _WORKER_FNS[spec] = spec.load()
    return [_score_one(fn, *item) for item in items]


def _init_worker() -> None:
    # Reward workers share the machine with training; one thread each for any numeric library.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# What `reward.max_error_fraction` defaults to (rlframe.config.schema.RewardConfig).
DEFAULT_MAX_ERROR_FRACTION = 0.5


class RewardErrorsExceeded(RuntimeError):
    """More than the allowed fraction of one batch's rewards failed; the message holds the first traceback."""

    def __init__(self, *, failed: int, total: int, max_error_fraction: float | None, first_traceback: str,
                 message: str | None = None):
        self.failed, self.total, self.max_error_fraction = failed, total, max_error_fraction
        self.first_traceback = first_traceback
        super().__init__(message or
            f"the reward function failed on {failed} of {total} samples of a batch, more than "
            f"reward.max_error_fraction={max_error_fraction} allows, so the run stops instead of training on "
            f"zeros. The first failure:\n{first_traceback.rstrip()}\n"
            "Fix the reward function, or give your own with reward.function_path (a .py file) and "
            "reward.function_name (default compute_score); set reward.max_error_fraction=1.0 to train on anyway.")


@dataclass
class RewardResult:
    scores: np.ndarray  # (B,) float32
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (B,) float32, NaN where absent
    metrics: dict[str, float] = field(default_factory=dict)
    failed: np.ndarray | None = None  # (B,) bool: the function raised or returned no usable score
    # name -> (B,) object: the string extra each sample returned, None where absent (a reason, a label);
    # not metrics, kept for the generation dumps' score_parts
    texts: dict[str, np.ndarray] = field(default_factory=dict)


class RewardManager:
    """Scores batches of decoded responses with one reward function (verl signature).

    Args:
        fn_spec: which function (built-in dispatch by data_source, or a file + name). Loaded and
            validated once here, so a bad path or signature fails at start.
        num_workers: processes in the pool; 0 scores inline in the calling process.
        timeout_s: seconds a batch may take in the pool before its unfinished samples count as errors.
        max_logged_errors: tracebacks logged over the manager's lifetime (then only counted); a
            traceback equal to one already logged is not logged again.
        max_error_fraction: a batch with more than this fraction of failed samples raises
            `RewardErrorsExceeded` (None or 1.0: never; the trainer passes reward.max_error_fraction).

    Example:
        >>> mgr = RewardManager(num_workers=0)
        >>> mgr.compute(["81"], data_sources=["arithmetic"], ground_truths=["81"]).scores
        array([1.], dtype=float32)
    """

    def __init__(
        self,
        *,
        fn_spec: RewardFnSpec | None = None,
        num_workers: int = DEFAULT_NUM_WORKERS,
        timeout_s: float = 120.0,
        max_logged_errors: int = 3,
        max_error_fraction: float | None = None,
    ):
        if num_workers < 0:
            raise ValueError(f"reward num_workers must be >= 0 (0 = inline), got {num_workers}")
        if max_error_fraction is not None and not 0.0 <= max_error_fraction <= 1.0:
            raise ValueError(f"max_error_fraction must be in [0, 1] (None: never stop), got {max_error_fraction}")
        self.fn_spec = fn_spec or RewardFnSpec()
        self.fn = self.fn_spec.load()  # validates path, name and signature now, in the driver
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.max_logged_errors = max_logged_errors
        self.max_error_fraction = max_error_fraction
        self.errors_logged = 0
        self._logged_tracebacks: set[str] = set()
        self._pool: ProcessPoolExecutor | None = None

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the caller may be a Ray actor or hold torch threads, which fork breaks.
            ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self.num_workers, mp_context=ctx, initializer=_init_worker)
        return self._pool

    def _reset_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()  # a stuck reward fn never returns; killing is the only way to reclaim it
        pool.shutdown(wait=False, cancel_futures=True)

    def _run_pool(self, items: list[tuple]) -> list[Outcome]:
        """Score contiguous chunks in the pool; chunks unfinished at the deadline count as errors."""
        n_chunks = min(len(items), 4 * self.num_workers)
        bounds = np.linspace(0, len(items), n_chunks + 1).astype(int)
        pool = self._get_pool()
        futures = [pool.submit(score_chunk, self.fn_spec, items[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        deadline = time.monotonic() + self.timeout_s
        outcomes: list[Outcome] = []
        broken = False
        for fut, a, b in zip(futures, bounds[:-1], bounds[1:]):
            try:
                # Once the pool is reset, only results that are already there are taken (timeout 0).
                outcomes.extend(fut.result(timeout=0 if broken else max(0.0, deadline - time.monotonic())))
            except Exception as exc:  # noqa: BLE001 - timeout, dead worker or cancelled after a reset
                what = "timed out" if isinstance(exc, FutureTimeout) else f"failed ({exc!r})"
                outcomes.extend([(0.0, {}, f"reward worker {what} for samples {a}..{b - 1}")] * (b - a))
                if not broken:
                    broken = True
                    self._reset_pool()
        return outcomes

    def compute(
        self,
        responses: Sequence[str],
        *,
        data_sources: Sequence[str],
        ground_truths: Sequence,
        extra_infos: Sequence[dict | None] | None = None,
    ) -> RewardResult:
        """Scores (B,) and metrics for B decoded responses."""
        n = len(responses)
        if not (len(data_sources) == len(ground_truths) == n) or (extra_infos is not None and len(extra_infos) != n):
            raise ValueError(
                f"reward inputs must have one entry per response: responses={n}, data_sources={len(data_sources)}, "
                f"ground_truths={len(ground_truths)}, extra_infos={None if extra_infos is None else len(extra_infos)}"
            )
        extra_infos = [None] * n if extra_infos is None else list(extra_infos)
        items = list(zip(data_sources, responses, ground_truths, extra_infos))
        if self.num_workers == 0 or n == 0:
            outcomes = [_score_one(self.fn, *item) for item in items]
        else:
            outcomes = self._run_pool(items)
        return self._collect(outcomes)

    def _collect(self, outcomes: list[Outcome]) -> RewardResult:
        n = len(outcomes)
        scores = np.array([o[0] for o in outcomes], dtype=np.float32)
        names = sorted({k for o in outcomes for k, v in o[1].items() if not isinstance(v, str)})
        extras = {k: np.array([_number_or_nan(o[1].get(k)) for o in outcomes], dtype=np.float32) for k in names}
        text_names = sorted({k for o in outcomes for k, v in o[1].items() if isinstance(v, str)})
        texts = {k: np.array([v if isinstance(v := o[1].get(k), str) else None for o in outcomes], dtype=object)
                 for k in text_names}
        errors = [(i, o[2]) for i, o in enumerate(outcomes) if o[2] is not None]
        limit = self.max_error_fraction
        if errors and limit is not None and len(errors) > limit * n:
            raise RewardErrorsExceeded(failed=len(errors), total=n, max_error_fraction=limit,
                                       first_traceback=errors[0][1])
        for i, tb in errors:
            if self.errors_logged >= self.max_logged_errors:
                break
            if tb in self._logged_tracebacks:  # the same failure on every sample: said once
                continue
            self._logged_tracebacks.add(tb)
            self.errors_logged += 1
            logger.warning("reward function failed on sample %d (scored 0; %d of %d samples of this batch "
                           "failed):\n%s", i, len(errors), n, tb)
        failed = np.array([o[2] is not None for o in outcomes], dtype=bool)
        return RewardResult(scores=scores, extras=extras, metrics=reward_metrics(scores, extras, failed), failed=failed,
                            texts=texts)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def reward_metrics(scores: np.ndarray, extras: dict[str, np.ndarray], failed: np.ndarray) -> dict[str, float]:
    """`reward/mean`, `reward/errors`, and per extra `reward/<k>/mean` (averaged over ALL samples, a
    sample that did not return the key counting 0) with `reward/<k>/count` (how many returned it)."""
    n = len(scores)
    out = {"reward/errors": float(np.sum(failed)), "reward/mean": float(np.mean(scores)) if n else 0.0}
    for k, v in extras.items():
        present = np.isfinite(v)
        out[f"reward/{k}/mean"] = float(np.where(present, v, 0.0).sum() / n) if n else 0.0
        out[f"reward/{k}/count"] = float(present.sum())
    return out


def token_level_scores(scores, response_mask):
    """Place each sample's score on its last valid response token.

    Args:
        scores: (B,) scores (numpy or torch).
        response_mask: (B, R) 1 on response tokens that count (right-padded responses).
    Returns:
        (B, R) float32 tensor, zero except at index (i, last valid position of row i).
        Rows with no valid token stay all zero (no token to carry the reward).
    """
    import torch

    mask = torch.as_tensor(response_mask)
    s = torch.as_tensor(np.asarray(scores), dtype=torch.float32).to(mask.device)
    if mask.dim() != 2 or s.shape != (mask.shape[0],):
        raise ValueError(
            f"token_level_scores needs scores (B,) and response_mask (B, R); "
            f"got {tuple(s.shape)} and {tuple(mask.shape)}"
        )
    valid = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values  # (B,)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = s[rows]
    return out
