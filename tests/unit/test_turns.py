"""Multi-turn masks (holes where the environment's observations sit): GAE, discounted returns
and the turn bookkeeping, against numbers worked out by hand."""
import torch

from ds_ppo.algo import (discounted_returns, from_model_tokens, gae, gae_loop, is_prefix,
                         model_token_order, shape_rewards, to_model_tokens, turn_ends)

# turn 1 = tokens 0, 1; observation = tokens 2, 3; turn 2 = token 4; padding = token 5
MASK = torch.tensor([[True, True, False, False, True, False]])


def test_gae_across_an_observation_by_hand():
    # rewards and values only at model tokens; 7 and 9 at the observation (and padding) must
    # not matter
    rewards = torch.tensor([[0.0, 0.5, 7.0, 7.0, 1.0, 7.0]])
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4, 9.0]])
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, MASK, gamma, lam)
    # model-token steps s0 (token 0), s1 (token 1), s2 (token 4; the state after the
    # observation); s2 is the last: V after it = 0
    d0 = 0.0 + 0.9 * 0.2 - 0.1  # 0.08
    d1 = 0.5 + 0.9 * 0.4 - 0.2  # 0.66: the return carries across the observation
    d2 = 1.0 + 0.0 - 0.4  # 0.6
    a2 = d2
    a1 = d1 + 0.9 * 0.8 * a2  # 1.092
    a0 = d0 + 0.9 * 0.8 * a1  # 0.86624
    want_adv = torch.tensor([[a0, a1, 0.0, 0.0, a2, 0.0]])
    want_ret = torch.tensor([[a0 + 0.1, a1 + 0.2, 0.0, 0.0, a2 + 0.4, 0.0]])
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)
    assert abs(a0 - 0.86624) < 1e-6 and abs(a1 + 0.2 - 1.292) < 1e-6


def test_gae_with_holes_equals_gae_on_the_model_tokens_alone():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 40, generator=g) > 0.4
    mask[:, 30:] = False
    rewards, values = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    adv, ret = gae(rewards, values, mask, 0.97, 0.9)
    for b in range(5):
        idx = mask[b].nonzero().squeeze(1)
        n = len(idx)
        a, r = gae_loop(rewards[b, idx][None], values[b, idx][None], torch.ones(1, n, dtype=torch.bool),
                        0.97, 0.9)
        torch.testing.assert_close(adv[b, idx], a[0])
        torch.testing.assert_close(ret[b, idx], r[0])
        assert (adv[b, ~mask[b]] == 0).all() and (ret[b, ~mask[b]] == 0).all()


def test_prefix_masks_are_unchanged():
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(12)[None] < torch.tensor([[12], [5], [0]])
    rewards, values = torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)
    assert is_prefix(mask) and not is_prefix(MASK)
    torch.testing.assert_close(gae(rewards, values, mask, 1.0, 0.95),
                               gae_loop(rewards, values, mask, 1.0, 0.95))


def test_discounted_returns_carry_across_an_observation():
    rewards = torch.tensor([[1.0, 2.0, 9.0, 9.0, 3.0, 9.0]])
    got = discounted_returns(rewards, MASK, 0.5)
    g4 = 3.0
    g1 = 2.0 + 0.5 * g4  # 3.5: no step for the observation
    g0 = 1.0 + 0.5 * g1  # 2.75
    torch.testing.assert_close(got, torch.tensor([[g0, g1, 0.0, 0.0, g4, 0.0]]))


def test_turn_ends_and_the_score_at_the_last_model_token():
    assert turn_ends(MASK).tolist() == [[False, True, False, False, True, False]]
    rewards = shape_rewards(torch.tensor([2.0]), torch.ones(1, 6), MASK, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, -0.1, 0.0, 0.0, 1.9, 0.0]]))


def test_model_token_order_round_trips():
    order = model_token_order(MASK)
    x = torch.arange(6.0)[None]
    assert to_model_tokens(x, order).tolist() == [[0.0, 1.0, 4.0, 2.0, 3.0, 5.0]]
    assert to_model_tokens(MASK, order).tolist() == [[True, True, True, False, False, False]]
    assert torch.equal(from_model_tokens(to_model_tokens(x, order), order), x)
