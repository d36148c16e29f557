"""Does the L-BFGS value fit of trpo_gpt2_halfcheetah.py do worse in float32 than in float64? (issue 17)

Loads a `--policy mlp --save-model` checkpoint (policy, value net, observation statistics), collects one
15000-step batch (10 HalfCheetah-v5 envs) with its policy, computes the GAE returns with its value net, and
refits copies of that value net to them with `fit_value_lbfgs` in float64 and in float32: final MSE, number of
objective evaluations, explained variance.

    OMP_NUM_THREADS=1 python benchmark/trpo_value_fit_dtype.py benchmark/out/runs/<run>/runs/<name>/trpo_gpt2_halfcheetah.pt
"""

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trpo_gpt2_halfcheetah as trpo  # noqa: E402
import trpo_profile as tp  # noqa: E402


def main(path: str) -> None:
    torch.set_num_threads(1)
    ck = torch.load(path, weights_only=False)
    obs_dim, act_dim = ck["obs_dim"], ck["act_dim"]
    pol = trpo.MLPPolicy(obs_dim, act_dim).double()
    pol.load_state_dict(ck["policy"])
    vn = trpo.ValueNet(obs_dim).double()
    vn.load_state_dict(ck["value"])
    rms = trpo.RunningMeanStd(obs_dim)
    rms.load_state_dict(ck["obs_rms"])
    envs = tp.make_envs(trpo, 10)
    raw, _ = envs.reset(seed=5)
    rms.update(raw)
    torch.manual_seed(5)
    batch, _ = tp.rollout(trpo, pol, envs, rms, rms.normalize(raw), 1500, torch.float64)
    obs_buf, next_obs_buf, _, rewards, terms, dones = batch
    T, N, _ = obs_buf.shape
    with torch.no_grad():
        values = vn(torch.from_numpy(obs_buf.reshape(-1, obs_dim)).double()).numpy().reshape(T, N)
        next_values = vn(torch.from_numpy(next_obs_buf.reshape(-1, obs_dim)).double()).numpy().reshape(T, N)
    _, ret = trpo.compute_gae(rewards, values, next_values, terms, dones, 0.995, 0.97)
    print(f"returns: mean {ret.mean():.2f}, std {ret.std():.2f}")
    for dt in (torch.float64, torch.float32):
        v = copy.deepcopy(vn).to(dt)
        obs = torch.from_numpy(obs_buf.reshape(-1, obs_dim)).to(dt)
        tg = torch.from_numpy(ret.reshape(-1)).to(dt)
        count, orig = [0], torch.optim.LBFGS.step

        def counting_step(self, closure):
            def counted():
                count[0] += 1
                return closure()
            return orig(self, counted)

        torch.optim.LBFGS.step = counting_step
        try:
            with torch.no_grad():
                before = float((v(obs) - tg).pow(2).mean())
            after = trpo.fit_value_lbfgs(v, obs, tg, 1e-3, 25)
        finally:
            torch.optim.LBFGS.step = orig
        with torch.no_grad():
            ev = 1 - float((v(obs) - tg).double().var() / tg.double().var())
        print(f"{dt}: MSE {before:.2f} -> {after:.2f}, {count[0]} objective evaluations, explained variance {ev:.4f}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isfile(sys.argv[1]):
        sys.exit("usage: python benchmark/trpo_value_fit_dtype.py PATH_TO_CHECKPOINT.pt (an existing file)")
    main(sys.argv[1])
