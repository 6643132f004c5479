import pytest
import torch

from rlframe.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    Registry,
    get_advantage_estimator,
    get_kl_estimator,
    get_loss_agg_mode,
    get_policy_loss,
    register_advantage_estimator,
)


def test_builtins_are_registered_under_their_names_and_aliases():
    assert {"gae", "grpo", "dr_grpo", "rloo", "remax", "reinforce_plus_plus",
            "reinforce_plus_plus_baseline", "lite_ppo"} <= set(ADVANTAGE_ESTIMATORS.names())
    assert get_policy_loss("ppo") is get_policy_loss("vanilla")
    assert get_kl_estimator("k3") is get_kl_estimator("low_var_kl")
    assert get_advantage_estimator("lite_ppo") is get_advantage_estimator("group_mean_batch_std")
    assert callable(get_loss_agg_mode("seq-mean-token-sum-norm"))


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'.*'dual_clip'.*'gspo'.*'ppo'"):
        get_policy_loss("ppo2")


def test_duplicate_name_names_the_existing_function():
    with pytest.raises(ValueError, match=r"'grpo' is already registered to rlframe\.algos\.group_advantages\.grpo"):

        @register_advantage_estimator("grpo")
        def my_grpo(*, token_level_rewards, response_mask, index=None, values=None,
                    baseline_rewards=None, gamma=1.0, lam=1.0, epsilon=1e-6):
            raise AssertionError("never called")


def test_user_registration_then_lookup_in_a_fresh_registry():
    reg = Registry("widget", required_params=("x",))

    @reg.register("double")
    def double(*, x):
        return 2 * x

    assert reg.get("double")(x=torch.tensor(3.0)) == 6.0
    assert reg.names() == ["double"] and "double" in reg
    with pytest.raises(ValueError, match=r"widget 'double' is already registered to .*double"):
        reg.register("double")(lambda *, x: x)


def test_signature_is_checked_at_registration():
    reg = Registry("widget", required_params=("x", "y"))
    with pytest.raises(ValueError, match=r"does not accept the keyword arguments \['y'\]"):
        reg.register("bad")(lambda *, x: x)
    reg.register("kwargs_ok")(lambda **kw: kw)  # **kwargs accepts everything
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("")


def test_a_registered_user_estimator_is_callable_by_name():
    name = "test_registry_constant_estimator"

    @register_advantage_estimator(name)
    def constant(*, token_level_rewards, response_mask, index=None, values=None,
                 baseline_rewards=None, gamma=1.0, lam=1.0, epsilon=1e-6):
        adv = torch.ones_like(token_level_rewards) * response_mask
        return adv, adv

    try:
        adv, _ = get_advantage_estimator(name)(token_level_rewards=torch.zeros(2, 3),
                                               response_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]))
        assert adv.tolist() == [[1, 1, 0], [1, 0, 0]]
    finally:
        ADVANTAGE_ESTIMATORS._table.pop(name)  # keep the shared registry as the other tests expect
