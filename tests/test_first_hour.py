"""A new user's first hour: a flag changed on --resume is refused in one line, not silently ignored. The README's first
run as written (train, resume, evaluate) is tests/test_readme_commands.py's."""

from conftest import copy_run, run_script


def test_a_changed_training_flag_is_refused_on_resume(tiny_run, tmp_path):
    """--e-pi 2 on a run trained with 1: refused in one line, as the command line names it (the __main__ block)."""
    run = copy_run(tiny_run("ppg_procgen.py"), tmp_path)
    proc = run_script("ppg_procgen.py", "--resume", str(run), "--e-pi", "2", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: --e-pi 2: a resumed run keeps its flags (1)" in proc.stderr
