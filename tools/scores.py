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
