"""A new user's first hour: CleanRL's names of four flags as aliases of ours (on --resume too). The README's first run
as written (train, resume, evaluate) is tests/test_readme_commands.py's."""

import ast
import typing

import pytest
import tyro

from conftest import ALIASES, ROOT, SCRIPTS, copy_run, load_script, run_script


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
