"""Check on a live run that the rollout engine holds exactly the trainer's weights (DESIGN.md section
11: "after a weight sync the rollout engine holds exactly the trainer's weights"), for a preflight
command or every `trainer.check_weight_sync_every` steps.

    result = check_weight_sync(roles)          # roles: RunRoles (controller/trainers/roles.py)
    weight_check_metrics(result)               # {"sync/checked_slices": n, "sync/mismatched_slices": k,
                                               #  "sync/unverifiable_slices": u, "timing_s/weight_check": s}
    result["mismatched"]                       # the first few slices that differ, by name and rank

Every generation rank reads back each slice of each HF parameter it holds (its vLLM tp slice, in HF
coordinates) and hashes it in its own dtype; the actor's training ranks gather the same parameters
one bucket at a time, cast them to that dtype as the sync does, and hash the same slices
(workers/rollout/checksum.py). A slice is checked when both sides could hash it, mismatched when the
digests differ, unverifiable when either side could not read it back (e.g. a quantised layer).
With LoRA only the base weights are compared; the synced adapters are listed under "not_covered".

When: the comparison means something only right after a sync, so by default (`sync_first=True`)
the check completes a pending one first.
- Colocated (hybrid engine): after an update the actor syncs lazily, at the start of the next
  generate. The check runs that sync now, in the same processes and with the same plan, and the
  next generate finds nothing to sync: what is checked is exactly what the next generation uses.
  That step's `reshard/*` and `timing_s/update_weights` metrics are then not logged (the sync
  happened inside the check, whose time is `timing_s/weight_check`).
- Split placement: the actor's weights are pushed to the generation group (`RunRoles.push_weights`,
  nothing moves when they have not changed), as generate_sequences would do before generating; that
  push's `reshard/*` metrics are not logged either (its time is inside `timing_s/weight_check`).
  With asynchronous training (trainer.max_staleness > 0) the pipeline chooses when to push: the
  trainer's `request_weight_check` (ppo.py) runs the check with `sync_first=False` right after the
  batch pipeline's push, or pushes at a streaming round's boundary and records the new version; a
  push the pipeline does not know of would make later batches fresher than their `policy_version`.
With `sync_first=False` and a sync pending nothing is compared: result["skipped"] says why.
"""

from __future__ import annotations

import time

MAX_NAMES = 5  # how many mismatched / unverifiable slices the result names


def check_weight_sync(roles, *, sync_first: bool = True, max_names: int = MAX_NAMES) -> dict:
    """Compare every generation rank's weight slices with the actor's current weights; see the module
    docstring. Returns the metrics ("sync/...", "timing_s/weight_check") and, under non-metric keys,
    "mismatched" / "unverifiable" (the first `max_names`, "<name>[<slice>] (rollout rank r)"),
    "not_covered" (what the sync writes but the check does not read) and "skipped" (None, or why
    nothing was compared)."""
    t0 = time.perf_counter()
    per_rank = _rollout_digests(roles, sync_first=sync_first)
    if per_rank is None:
        return _result(t0, skipped="the actor was updated since the last sync and sync_first=False: the rollout "
                                   "engine still holds the previous weights; check right after a sync")
    requests = sorted({(d.name, d.box, d.dtype) for r in per_rank for d in r["slices"] if d.verifiable},
                      key=lambda q: (q[0], q[1].offsets, q[1].sizes, q[2]))
    trainer = next(t for t in roles.actor.trainer_weight_digests(requests) if t is not None)
    checked, mismatched, unverifiable = _compare(per_rank, trainer)
    not_covered = sorted({n for r in per_rank for n in r["not_covered"]})
    return _result(t0, checked=checked, mismatched=mismatched, unverifiable=unverifiable, not_covered=not_covered,
                   max_names=max_names)


def _compare(per_rank: list[dict], trainer: dict[str, str]) -> tuple[int, list[str], list[str]]:
    """(slices compared, mismatched ones, unverifiable ones with why) over every rollout rank."""
    from rlframe.workers.rollout.checksum import UNVERIFIABLE

    checked, mismatched, unverifiable = 0, [], []
    for rank, answer in enumerate(per_rank):
        for d in answer["slices"]:
            theirs = trainer.get(d.key, UNVERIFIABLE + "the trainer gave no digest for it")
            if not d.verifiable or theirs.startswith(UNVERIFIABLE):
                why = (theirs if d.verifiable else d.digest).removeprefix(UNVERIFIABLE)
                unverifiable.append(f"{d.key} (rollout rank {rank}): {why}")
                continue
            checked += 1
            if theirs != d.digest:
                mismatched.append(f"{d.key} (rollout rank {rank})")
    return checked, mismatched, unverifiable


def weight_check_metrics(result: dict) -> dict[str, float]:
    """The numeric entries of a `check_weight_sync` result (what a metrics logger takes)."""
    return {k: float(v) for k, v in result.items() if "/" in k and isinstance(v, (int, float))}


def _rollout_digests(roles, *, sync_first: bool) -> list[dict] | None:
    """Each generation rank's {"slices", "not_covered"}, after completing a pending sync (or None when
    one is pending and sync_first is off)."""
    if roles.generator is None:
        answers = roles.actor.rollout_weight_digests(sync_first=sync_first)
        return None if any(a is None for a in answers) else answers
    if sync_first:
        roles.push_weights()
    elif roles.weights_pending():
        return None
    return roles.generator.rollout_weight_digests()


def _result(t0: float, *, checked: int = 0, mismatched=(), unverifiable=(), not_covered=(), skipped=None,
            max_names: int = MAX_NAMES) -> dict:
    return {"sync/checked_slices": checked, "sync/mismatched_slices": len(mismatched),
            "sync/unverifiable_slices": len(unverifiable), "timing_s/weight_check": time.perf_counter() - t0,
            "mismatched": list(mismatched)[:max_names], "unverifiable": list(unverifiable)[:max_names],
            "not_covered": list(not_covered), "skipped": skipped}
