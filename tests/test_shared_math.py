"""Math that several scripts carry, each in its own copy (the scripts share no code by design):
one hand-computed case per function, checked against every script's copy."""

import math

import numpy as np
import pytest
import torch

import gpt2ppo_lunar
import ppo_cartpole
import trpo_gpt2_halfcheetah


@pytest.mark.parametrize("module", [ppo_cartpole, trpo_gpt2_halfcheetah, gpt2ppo_lunar], ids=lambda m: m.__name__)
@pytest.mark.parametrize("array", [np.array, torch.tensor], ids=["numpy", "torch"])
def test_gae_truncation_bootstrapped_termination_not(module, array):
    # Two envs, three steps, gamma 0.9, lambda 0.8 (hand-computed below).
    # env 0 is truncated at t=1: its TD error keeps gamma * V(final obs) = 0.9 * 2.0.
    # env 1 terminates at t=1: its V(final obs) = 5.0 must be ignored.
    rewards = array([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    values = array([[0.5, 1.0], [0.6, 1.0], [0.7, 1.0]])
    next_values = array([[0.6, 1.0], [2.0, 5.0], [0.9, 2.0]])
    terminations = array([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    dones = array([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    adv, ret = module.compute_gae(rewards, values, next_values, terminations, dones, 0.9, 0.8)
    # env 0: A2 = 1 + .81 - .7 = 1.11; A1 = 1 + 1.8 - .6 = 2.2 (episode boundary);
    #        A0 = (1 + .54 - .5) + .72 * 2.2 = 2.624
    # env 1: A2 = .9*2 - 1 = .8; A1 = 1 - 1 = 0 (terminal); A0 = .9 - 1 + .72 * 0 = -.1
    expected = np.array([[2.624, -0.1], [2.2, 0.0], [1.11, 0.8]])
    assert np.allclose(np.asarray(adv), expected, atol=1e-6)
    assert np.allclose(np.asarray(ret), expected + np.asarray(values), atol=1e-6)


@pytest.mark.parametrize("module", [ppo_cartpole, gpt2ppo_lunar], ids=lambda m: m.__name__)
def test_clipped_surrogate_hand_computed(module):
    old = torch.zeros(3)
    new = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    adv = torch.tensor([1.0, -2.0, 3.0])
    loss, approx_kl, clipfrac = module.clipped_surrogate_loss(new, old, adv, 0.2)
    # per sample max(-A r, -A clip(r)): -1.2, 1.6, -3.3
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 3.3) / 3, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3)
    kl = np.mean([r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)])
    assert approx_kl.item() == pytest.approx(kl, abs=1e-6)
