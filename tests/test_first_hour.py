"""A new user's first hour: the README's first run as written (train, resume, evaluate), CleanRL's names of four
flags as aliases of ours (on --resume too), and the console lines a run prints."""

import ast
import os
import pathlib
import re
import subprocess
import sys
import typing

import pytest
import tyro

from conftest import ALIASES, PATIENCE_S, ROOT, SCRIPTS, copy_run, load_script, run_script


@pytest.mark.parametrize("name", SCRIPTS)
def test_cleanrl_names_parse_as_ours(name):
    """Each alias gives the same Args as our name, the Args declare no other alias, and the __main__ block maps the
    same names (for --resume): an alias added to Args alone would count as an unknown flag on --resume."""
    script = load_script(name)
    declared = {}
    for ours, hint in typing.get_type_hints(script.Args, include_extras=True).items():
        for marker in getattr(hint, "__metadata__", ()):
            for alias in getattr(marker, "aliases", None) or ():
                declared[alias[2:].replace("-", "_")] = ours
    assert declared == ALIASES
    for alias, ours in ALIASES.items():
        as_alias = tyro.cli(script.Args, args=[f"--{alias.replace('_', '-')}", "3"])
        assert as_alias == tyro.cli(script.Args, args=[f"--{ours.replace('_', '-')}", "3"]) != script.Args(), alias
    main_block = next(n for n in ast.parse((ROOT / name).read_text()).body if isinstance(n, ast.If))
    mapping = next(n.value for n in ast.walk(main_block) if isinstance(n, ast.Assign) and n.targets[0].id == "aliases")
    assert {keyword.arg: keyword.value.value for keyword in mapping.keywords} == ALIASES


def test_an_alias_counts_on_resume(tiny_run, tmp_path):
    """--e-policy is --e-pi: on --resume, a value other than the run's is refused in one line, not silently ignored."""
    run = copy_run(tiny_run("ppg_procgen.py"), tmp_path)
    proc = run_script("ppg_procgen.py", "--resume", str(run), "--e-policy", "2", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: --e-pi 2: a resumed run keeps its flags (1)" in proc.stderr


def test_the_readme_first_run_trains_resumes_and_evaluates_as_written(tmp_path):
    """The README's first-run block, as one shell script, in a folder holding the script and tools/ as the repository
    does, and an earlier run's folder of the same name (a rerun of the block): it trains, resumes its own run from its
    checkpoint to a raised budget, and evaluates that policy."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- first-run:.*?-->\n```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in block.splitlines() if line.startswith("python")]
    assert [c.split()[1] for c in commands] == ["ppg_procgen.py", "ppg_procgen.py", "tools/evaluate.py"]
    (tmp_path / "ppg_procgen.py").symlink_to(ROOT / "ppg_procgen.py")
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    (tmp_path / "runs" / "starpilot__first__1__1000").mkdir(parents=True)  # the first try's run, older
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a checkpoint after each phase, the first at step 256" in done.stdout and "aux epoch 2/2" in done.stdout
    assert "resumed from" in done.stdout and "phase 3/3 iter 5/5 step 640" in done.stdout
    assert "step 640" in done.stdout and "mean return" in done.stdout
    assert not list((tmp_path / "runs" / "starpilot__first__1__1000").iterdir())  # the older run left alone
