"""What only ppg_atari.py has: the env id mapping, whole-game logging with training-only life loss
and reward clipping, and the orthogonal init of its Nature CNN."""

import math

import numpy as np
import pytest
import torch

from conftest import load_script

atari = load_script("ppg_atari.py")


def test_env_id_styles_and_sticky_defaults():
    # v4: no sticky actions, up to 30 no-op starts, FIRE on reset (DQN / baselines)
    assert atari.ale_protocol("BreakoutNoFrameskip-v4") == ("ALE/Breakout-v5", 0.0, 30, True)
    # v5: Machado et al. 2018: sticky actions 0.25 and no no-op starts or FIRE on reset
    assert atari.ale_protocol("ALE/Breakout-v5") == ("ALE/Breakout-v5", 0.25, 0, False)
    atari.make_plan(atari.Args(env_id="ALE/Pong-v5"))
    with pytest.raises(SystemExit, match="SpaceInvaderNoFrameskip-v4: not an ale-py game id, as Breakout"):
        atari.make_plan(atari.Args(env_id="SpaceInvaderNoFrameskip-v4"))


def _play(clip_rewards: bool, episodic_life: bool, steps: int = 700):
    """Random play of 2 Asterix envs (rewards of 50, 3 lives), same seed and actions every call."""
    args = atari.Args(env_id="AsterixNoFrameskip-v4", clip_rewards=clip_rewards, episodic_life=episodic_life)
    envs = atari.AtariVecEnv(args, 2, seed=3)
    obs = envs.reset()
    assert obs.shape == (2, *atari.OBS_SHAPE) and obs.dtype == np.uint8
    rng = np.random.default_rng(0)
    rewards, dones, games = [], [], []
    for _ in range(steps):
        _, r, d, finished = envs.step(rng.integers(0, envs.num_actions, 2))
        rewards.append(r)
        dones.append(d)
        games += finished
    envs.env.close()
    return np.array(rewards), np.array(dones), games


def test_whole_game_returns_logged_while_training_sees_lives_and_clipped_rewards():
    train_r, train_d, games = _play(clip_rewards=True, episodic_life=True)
    raw_r, game_d, raw_games = _play(clip_rewards=False, episodic_life=False)
    assert games == raw_games and len(games) >= 2  # logging does not depend on the training options
    assert set(np.unique(train_r)) <= {-1.0, 0.0, 1.0}
    assert raw_r.max() >= 50  # raw Asterix rewards
    assert np.array_equal(np.sign(raw_r), train_r)
    # a lost life ends an episode for training only: more training dones than finished games
    assert game_d.sum() == len(games) and train_d.sum() > len(games)
    # each logged return is the raw score of a whole game (all lives), not of one life
    for env in range(2):
        ends = np.flatnonzero(game_d[:, env])
        starts = np.concatenate([[0], ends[:-1] + 1])
        scores = [raw_r[s : e + 1, env].sum() for s, e in zip(starts, ends)]
        assert scores == [ret for i, ret, _ in games if i == env]
        assert [e - s + 1 for s, e in zip(starts, ends)] == [length for i, _, length in games if i == env]


def test_orthogonal_init():
    """Every layer of both trunks (gain sqrt 2) and each head (0.01 policy, 1 values): orthogonal, bias 0."""
    torch.manual_seed(0)
    agent = atari.PPGAgent(atari.Args(), atari.OBS_SHAPE, 4)
    trunks = [m for trunk in (agent.pi_trunk, agent.v_trunk) for m in trunk.modules() if hasattr(m, "weight")]
    assert len(trunks) == 8  # 3 convs and a dense layer in each
    heads = [(agent.pi_head, 0.01), (agent.value_head, 1.0), (agent.aux_value_head, 1.0)]
    for layer, gain in [*((layer, math.sqrt(2)) for layer in trunks), *heads]:
        w = layer.weight.detach().flatten(1)
        rows = w @ w.T  # orthogonal rows (fewer rows than columns here): W W^T = gain^2 I
        assert torch.allclose(rows, gain**2 * torch.eye(w.shape[0]), atol=1e-4 * max(1, gain**2)), layer
        assert torch.count_nonzero(layer.bias) == 0


@pytest.mark.parametrize(
    "flags, sticky, noop_max, fire",
    [
        ([], 0.0, 30, True),  # a v4 id: DQN's protocol
        (["--env-id", "ALE/Breakout-v5"], 0.25, 0, False),  # a v5 id: Machado et al.'s
        (["--repeat-action-probability", "0.1"], 0.1, 30, True),
    ],
)
def test_the_protocol_reaches_the_emulator(flags, sticky, noop_max, fire, monkeypatch):
    """The settings ale-py's emulator is built with, read where AtariVecEnv's envs hand them to it."""
    import ale_py
    import tyro

    built = []
    original = ale_py.ALEVectorInterface

    def record(**settings):
        built.append(settings)
        return original(**settings)

    monkeypatch.setattr(ale_py, "ALEVectorInterface", record)
    args = tyro.cli(atari.Args, args=["--max-episode-frames", "5000", *flags])
    envs = atari.AtariVecEnv(args, 2, seed=1)
    envs.env.close()
    (settings,) = built
    assert settings["repeat_action_probability"] == pytest.approx(sticky)
    assert (settings["noop_max"], settings["use_fire_reset"]) == (noop_max, fire)
    # life loss and reward clipping are the wrapper's (training only), the frame cap the flag's
    assert (settings["episodic_life"], settings["reward_clipping"], settings["max_episode_steps"]) == (
        False,
        False,
        5000,
    )
    assert (settings["frame_skip"], settings["stack_num"], settings["img_height"], settings["grayscale"]) == (
        4,
        4,
        84,
        True,
    )
