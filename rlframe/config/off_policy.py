"""Config rules of the off-policy corrections (rlframe/algos/rollout_correction.py), called by
`validate`: the problems go to its list with what, why and how to fix."""

from __future__ import annotations

from rlframe.algos.rollout_correction import CORRECTION_BANDS, correction_band
from rlframe.config.schema import RunConfig


def check_rollout_correction(cfg: RunConfig, out: list[str]) -> None:
    """The off-policy correction's settings: a band only for masking methods and containing 1, masks
    only on off-policy runs sampling the full distribution, no KL bound against itself, none for online
    DPO (whose loss has no ratio to correct)."""
    alg = cfg.algorithm
    method = alg.off_policy_correction
    given = [f"algorithm.{k}={getattr(alg, k)}" for k in ("mask_low", "mask_high") if getattr(alg, k) is not None]
    if method not in CORRECTION_BANDS:
        if given:
            out.append(f"{' and '.join(given)} set the band of a masking correction, but "
                       f"algorithm.off_policy_correction={method} masks nothing; use one of "
                       f"{', '.join(CORRECTION_BANDS)}, or leave mask_low / mask_high null")
    else:
        low, high = correction_band(method, alg.mask_low, alg.mask_high)
        if not low <= 1.0 <= high:
            out.append(f"algorithm.off_policy_correction={method} keeps ratios in [mask_low, mask_high] = "
                       f"[{low}, {high}], which leaves out 1 (a token sampled by the weights being trained "
                       f"would be masked); choose mask_low <= 1 <= mask_high, e.g. the default "
                       f"{list(CORRECTION_BANDS[method])}")
    drops = [f"algorithm.off_policy_correction={method}"] if method in CORRECTION_BANDS else []
    drops += [f"algorithm.rejection_kl={alg.rejection_kl}"] if alg.rejection_kl is not None else []
    if drops and not cfg.off_policy:
        out.append(f"{' and '.join(drops)} drop tokens of off-policy batches, but this run is synchronous "
                   "(trainer.max_staleness=0, rollout.partial_budget=0): every batch is on-policy and nothing "
                   "would be dropped; set max_staleness > 0 (with resources.placement=split) or partial_budget > 0, "
                   "or leave them off")
    sampling = [f"rollout.{k}={v}" for k, v, on in (("top_p", cfg.rollout.top_p, cfg.rollout.top_p < 1),
                                                     ("top_k", cfg.rollout.top_k, cfg.rollout.top_k > 0)) if on]
    if drops and sampling:
        out.append(f"{' and '.join(drops)} compare the rollout's log-probs with the actor's, but with "
                   f"{' and '.join(sampling)} the rollout's are of the truncated distribution: even tokens sampled "
                   "by the weights being trained have a ratio below 1 and would be dropped; sample from the full "
                   "distribution (top_p=1, top_k=-1) or use off_policy_correction=tis without rejection_kl")
    from rlframe.config.algorithms import algorithm_spec, known

    pairs = known(alg) and algorithm_spec(alg).pairs  # a pair loss: no ratio to correct
    if pairs and (method != "none" or alg.rejection_kl is not None):
        keys = [f"algorithm.off_policy_correction={method}"] if method != "none" else []
        keys += [f"algorithm.rejection_kl={alg.rejection_kl}"] if alg.rejection_kl is not None else []
        out.append(f"{' and '.join(keys)} correct the PPO-family update of off-policy samples, but {alg.name}'s "
                   "loss compares the chosen and rejected responses with the reference model and has no ratio to "
                   "the rollout's policy: the setting would be ignored; leave algorithm.off_policy_correction=none "
                   "and algorithm.rejection_kl=null (off-policy pairs need no correction)")
    if alg.rejection_kl is not None and method == "behaviour":
        out.append(f"algorithm.rejection_kl={alg.rejection_kl} measures the KL from the rollout's policy to the "
                   "update's old one, but off_policy_correction=behaviour makes them the same (always 0); "
                   "use another correction (none, tis, ...) or rejection_kl=null")
