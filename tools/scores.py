"""The Procgen paper's (R_min, R_max) of each game in easy and hard mode (arXiv 1912.01588), to normalise returns as
the PPG paper does: (R - R_min) / (R_max - R_min). Used by tools/evaluate.py and tools/report.py."""

RANGES = """
    game      easy_min easy_max hard_min hard_max
    bigfish          1       40        0       40
    bossfight      0.5       13      0.5       13
    caveflyer      3.5       12        2     13.4
    chaser         0.5       13      0.5     14.2
    climber          2     12.6        1     12.6
    coinrun          5       10        5       10
    dodgeball      1.5       19      1.5       19
    fruitbot      -1.5     32.4     -0.5     27.2
    heist          3.5       10        2       10
    jumper           3       10        1       10
    leaper           3       10      1.5       10
    maze             5       10        4       10
    miner          1.5       13      1.5       20
    ninja          3.5       10        2       10
    plunder        4.5       30        3       30
    starpilot      2.5       64      1.5       35
"""
_ROWS = [row.split() for row in RANGES.strip().splitlines()[1:]]
NORMALISATION = {mode: {r[0]: (float(r[i]), float(r[i + 1])) for r in _ROWS} for mode, i in (("easy", 1), ("hard", 3))}


def normalised_score(game: str, mode: str, episode_return: float) -> float:
    r_min, r_max = NORMALISATION[mode][game]
    return (episode_return - r_min) / (r_max - r_min)


# openai/train-procgen at TRAIN_PROCGEN_COMMIT: its PPO under its generalization protocol (easy mode, trained on levels
# 0 to 199, scored on the full level distribution by a test worker of 64 envs with the same weights, actions sampled),
# the figures tools/report.py sets beside a generalization sweep (tools/train_procgen.py recomputes them from a
# checkout). Its own easy ranges (train_procgen/constants.py, EASY_GAME_RANGES) normalise them; they differ from the
# Procgen paper's easy column of RANGES in jumper (1, not 3) and leaper (1.5, not 3), and are the hard ones there.
TRAIN_PROCGEN_REPOSITORY = "https://github.com/openai/train-procgen"
TRAIN_PROCGEN_COMMIT = "1a2ae2194a61f76a733a39339530401c024c3ad8"
TRAIN_PROCGEN_RUNS = ("easy-200-run0", "easy-200-run1", "easy-200-run2")  # train_procgen/results/<run>/
TRAIN_PROCGEN_EASY = {game: NORMALISATION["easy"][game] for game in NORMALISATION["easy"]}
TRAIN_PROCGEN_EASY.update(jumper=(1.0, 10.0), leaper=(1.5, 10.0))
# Each run's eprewmean (the mean return of its worker's last 100 episodes), the mean of its CSV's last 10 rows at or
# below 25.1M env steps (24,936,448 to 25,083,904: a row every 64 envs x 256 steps), in the test CSV (progress-<game>-
# test.csv: the full distribution) and the train CSV (progress-<game>-train.csv: the 200 training levels). Mean
# normalised score of the runs' mean per game over the 16 games: test 0.359 (0.35948), train 0.600 (0.59968).
TRAIN_PROCGEN_TABLE = """
    game        test_run0 test_run1 test_run2 train_run0 train_run1 train_run2
    bigfish         4.959     5.092     3.958     12.971     11.513     12.552
    bossfight       6.861     6.601     8.481      8.281      7.827      8.793
    caveflyer       5.278     5.921     5.187      6.958      7.961      6.807
    chaser          5.950     6.466     5.688      7.299      7.147      6.175
    climber         5.999     5.994     5.943      8.648      8.766      8.639
    coinrun         8.620     8.610     8.740      9.420      9.510      9.570
    dodgeball       1.924     1.588     2.276      5.284      3.998      5.984
    fruitbot       26.469    26.338    26.693     30.231     29.278     29.145
    heist           3.070     2.590     2.520      8.390      8.130      7.540
    jumper          5.560     5.790     5.690      8.330      8.680      8.540
    leaper          6.340     4.600     7.120      7.130      4.810      7.340
    maze            5.810     5.710     5.980      9.440      9.260      9.340
    miner           9.482     9.345     9.498     12.829     12.842     12.831
    ninja           5.160     6.010     5.620      7.390      7.720      7.340
    plunder         4.188     5.491     4.623      5.158      5.956      5.042
    starpilot      26.411    21.695    25.539     31.248     28.173     33.965
"""
TRAIN_PROCGEN_AT = 25_083_904  # the env step of the table's last rows
TRAIN_PROCGEN_PPO = {
    row[0]: {"test": [float(v) for v in row[1:4]], "train": [float(v) for v in row[4:7]]}
    for row in (line.split() for line in TRAIN_PROCGEN_TABLE.strip().splitlines()[1:])
}


def train_procgen_score(game: str, episode_return):
    """A return normalised by train-procgen's easy range of the game."""
    r_min, r_max = TRAIN_PROCGEN_EASY[game]
    return (episode_return - r_min) / (r_max - r_min)
