"""Registries by name: one small mechanism for every kind of algorithm piece.

The trainer looks algorithms up by the name in its config (`algorithm.adv_estimator: grpo`,
`actor.policy_loss: gspo`, ...). Users add their own by registering a function under a new name:

    from rlframe.algos import register_advantage_estimator

    @register_advantage_estimator("my_estimator")
    def my_estimator(*, token_level_rewards, response_mask, index=None, values=None,
                     baseline_rewards=None, gamma=1.0, lam=1.0, epsilon=1e-6):
        ...
        return advantages, returns

Each kind has one `Registry`, and each registry fixes the keyword arguments its functions must
accept, so a function that would fail on its first call fails at registration instead. A kind may
also take traits at registration (an advantage estimator says whether it needs a critic, groups of
samples, or an extra rollout; `estimator_spec(name)` reads them back), so the rest of rlframe asks
the traits and never compares names:

    @register_advantage_estimator("my_gae", needs_critic=True) The
built-in functions live in modules that register themselves on import; `get` imports them first,
so `get_policy_loss("ppo")` works without importing anything else. A name may be registered once;
stacking two decorators registers one function under two names (an alias).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable


class Registry:
    """Name -> function table of one kind (advantage estimators, policy losses, ...).

    Args:
        kind: what the functions are, for error messages ("advantage estimator").
        required_params: keyword arguments every registered function must accept (or take **kwargs).
        builtin_modules: modules that register the built-in functions; imported before any lookup.
        decorator_name: the public decorator users register with (in rlframe.algos), for error messages.
    """

    def __init__(self, kind: str, *, required_params: tuple[str, ...] = (), builtin_modules: tuple[str, ...] = (),
                 decorator_name: str | None = None, traits: type | None = None):
        self.kind = kind
        self.decorator_name = decorator_name
        self.required_params = required_params
        self._builtin_modules = builtin_modules
        self._table: dict[str, Callable] = {}
        self._traits_type = traits  # a dataclass of keyword-only traits, or None: the kind takes none
        self._traits: dict[str, object] = {}
        self._loaded = False

    def _load_builtins(self) -> None:
        # Built-ins load before any user registration too, so a user name that collides with a
        # built-in fails at the user's decorator, not later inside an unrelated import.
        # The flag is set first because the built-in modules call register() while importing.
        if self._loaded:
            return
        self._loaded = True
        try:
            for module in self._builtin_modules:
                importlib.import_module(module)
        except BaseException:
            self._loaded = False
            raise

    def _check_signature(self, name: str, fn: Callable) -> None:
        params = inspect.signature(fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        accepted = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        missing = [p for p in self.required_params if p not in accepted]
        if missing:
            raise ValueError(
                f"cannot register {self.kind} {name!r}: {_describe(fn)} does not accept the keyword "
                f"arguments {missing}. Every {self.kind} is called with the same keywords "
                f"{list(self.required_params)} so the trainer can call any of them by name; add the "
                f"missing ones to its signature (with defaults if unused), or accept **kwargs."
            )

    def register(self, name: str, **traits) -> Callable[[Callable], Callable]:
        """Decorator: register the decorated function under `name` (with its traits) and return it unchanged."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if traits and self._traits_type is None:
            raise ValueError(f"a {self.kind} takes no traits, got {sorted(traits)}")
        try:
            declared = self._traits_type(**traits) if self._traits_type is not None else None
        except TypeError as err:
            raise ValueError(f"{self.kind} {name!r}: {err}; its traits are the fields of "
                             f"{self._traits_type.__name__}") from None

        def decorator(fn: Callable) -> Callable:
            self._load_builtins()
            if name in self._table:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered to {_describe(self._table[name])}; "
                    f"cannot register {_describe(fn)} under the same name. Pick another name."
                )
            self._check_signature(name, fn)
            self._table[name] = fn
            self._traits[name] = declared
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        """The function registered under `name`; ValueError listing the known names otherwise."""
        self._load_builtins()
        try:
            return self._table[name]
        except KeyError:
            how = f"rlframe.algos.{self.decorator_name}" if self.decorator_name else "<registry>.register"
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {self.names()}. Check the spelling, or add one "
                f"with @{how}({name!r}) before it is looked up."
            ) from None

    def traits(self, name: str):
        """The traits `name` was registered with (ValueError for an unknown name, as `get`)."""
        self.get(name)
        return self._traits[name]

    def names(self) -> list[str]:
        """All registered names, sorted."""
        self._load_builtins()
        return sorted(self._table)

    def __contains__(self, name: str) -> bool:
        self._load_builtins()
        return name in self._table


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True)
class EstimatorTraits:
    """What an advantage estimator needs of the dataflow (keywords of `register_advantage_estimator`).

    needs_critic: it reads `values` (a critic's, per token): the run has a critic role.
    needs_groups: it compares the samples of one prompt (`index`): algorithm.n_samples >= 2.
    zero_mean_groups: its advantages sum to zero within each group (preflight checks it).
    extra_rollout: "greedy" when it needs a greedy sample per prompt (`baseline_rewards`, ReMax): the
        trainer generates it, so generation is not one batch per step (no asynchronous or partial
        rollouts); None otherwise.
    """

    needs_critic: bool = False
    needs_groups: bool = False
    zero_mean_groups: bool = False
    extra_rollout: str | None = None

    def __post_init__(self):
        if self.extra_rollout not in (None, "greedy"):
            raise ValueError(f"extra_rollout={self.extra_rollout!r}: the trainer generates None or 'greedy'")
        if self.zero_mean_groups and not self.needs_groups:
            raise ValueError("zero_mean_groups=True needs needs_groups=True (the groups it centres)")


# The keyword arguments each kind is called with (see the modules named for the full contract).
ADVANTAGE_ESTIMATORS = Registry(
    "advantage estimator",
    required_params=(
        "token_level_rewards", "response_mask", "index", "values", "baseline_rewards",
        "gamma", "lam", "epsilon",
    ),
    builtin_modules=("rlframe.algos.advantages", "rlframe.algos.group_advantages"),
    decorator_name="register_advantage_estimator",
    traits=EstimatorTraits,
)
POLICY_LOSSES = Registry(
    "policy loss",
    required_params=(
        "old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode",
        "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
        "global_token_count", "global_seq_count", "loss_scale_factor",
    ),
    builtin_modules=("rlframe.algos.policy_loss",),
    decorator_name="register_policy_loss",
)
KL_ESTIMATORS = Registry(
    "KL estimator",
    required_params=("log_prob", "ref_log_prob"),
    builtin_modules=("rlframe.algos.kl",),
    decorator_name="register_kl_estimator",
)
LOSS_AGG_MODES = Registry(
    "loss aggregation mode",
    required_params=("loss_mat", "loss_mask", "global_token_count", "global_seq_count", "loss_scale_factor"),
    builtin_modules=("rlframe.algos.aggregation",),
    decorator_name="register_loss_agg_mode",
)

register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get
estimator_spec = ADVANTAGE_ESTIMATORS.traits
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get
register_kl_estimator = KL_ESTIMATORS.register
get_kl_estimator = KL_ESTIMATORS.get
register_loss_agg_mode = LOSS_AGG_MODES.register
get_loss_agg_mode = LOSS_AGG_MODES.get


def resolve_loss_agg_mode(*, policy_loss: str, loss_agg_mode: str | None) -> str:
    """The aggregation a run uses: `algorithm.loss_agg_mode` when set, else the policy loss's own
    (the default of its `loss_agg_mode` parameter): "token-mean" for ppo / dual_clip, and
    "seq-mean-token-mean" for gspo, whose objective is a mean over sequences (Zheng et al. 2025)."""
    if loss_agg_mode is not None:
        return loss_agg_mode
    import inspect

    param = inspect.signature(POLICY_LOSSES.get(policy_loss)).parameters["loss_agg_mode"]
    return param.default if isinstance(param.default, str) else "token-mean"
