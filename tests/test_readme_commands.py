"""The README's commands work as written, right after its Quick start: each runs in a fresh copy of the checkout (the
files git tracks, copied to a temporary folder) with the authors' released code where the Quick start's clone puts it,
../phasic-policy-gradient (a link to the copy the other tests use: this test has no network), $PPG_RELEASED_CODE unset,
as in a new user's shell.

The commands are read from the README itself, so an edit of the README is tested: every line of its ```bash blocks
(a line ending in a backslash joined to the next), and the first-run block, marked `<!-- readme-commands: ... -->`,
as one shell script. A command runs unless a rule of LEFT_OUT names it, with the reason; adjusted() changes two kinds
of command, each with its reason, so that they finish in seconds and still check what the reader typed."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import released_shims as rs
from conftest import PATIENCE_S, ROOT

README = (ROOT / "README.md").read_text()

# Commands the test does not run, each with the reason; the first rule a command matches counts
LEFT_OUT = {
    r"^pip install ": "installs packages from the network: the test runs in the environment they made",
    r"^git clone ": "clones from the network: the test puts the released code where the clone puts it",
    r"^tensorboard ": "a server: it runs until stopped",
    r"^python -m pytest\b": "the test suite itself",
    r"<\w+>": "a placeholder for a run of the reader's own (runs/<run_name>)",
    r"^python ppg_\w+\.py (?!.*--help)": "a training run: hours on a CPU (the first-run block trains, tiny)",
    r"^python tools/(benchmark|checksums)\.py": "trains and times runs: minutes",
    r"^python tools/report\.py runs/": "reports a sweep's runs, which the test does not train",
}


def adjusted(command: str) -> str:
    """The command as the test runs it. A sweep without --dry-run would train its runs for hours: with --dry-run (put
    before any `--`) it parses every flag and lists its runs, training none. report.py's intervals draw 2,000 bootstrap
    resamples by default (about 30 s on 2 cores): --reps 50 changes their last digits, not the scores checked below."""
    if command.startswith("python tools/sweep.py ") and "--dry-run" not in command:
        head, dash, tail = command.partition(" -- ")
        command = f"{head} --dry-run{dash}{tail}"
    if command.startswith("python tools/report.py "):
        command += " --reps 50"
    return command


def readme_commands():
    """(the first-run block, [every other command line of the README's bash blocks, without its comment])."""
    first_run, commands = None, []
    for marker, block in re.findall(r"(<!-- readme-commands:[^>]*-->\n)?```bash\n(.*?)```", README, re.S):
        if marker:
            first_run = block
            continue
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"(^|\s)#.*", "", line).strip()  # a comment, whole line or trailing, is no command
            if command:
                commands.append(command)
    return first_run, commands


def left_out(command: str):
    """The reason a command is not run, or None."""
    return next((why for pattern, why in LEFT_OUT.items() if re.search(pattern, command)), None)


FIRST_RUN, COMMANDS = readme_commands()
RUN = [command for command in COMMANDS if left_out(command) is None]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A fresh copy of the checkout's tracked files (as they are in the working tree) and, beside it, the released
    code where the Quick start's clone puts it."""
    base = tmp_path_factory.mktemp("clone")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE_S)
    assert listed.returncode == 0, listed.stderr
    copy = base / "ppg"
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is gone from the copy too
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    released, _ = rs.released_root()
    if released is not None:
        (base / "phasic-policy-gradient").symlink_to(pathlib.Path(released).resolve())
    return copy


def shell(command: str, cwd) -> subprocess.Popen:
    """`bash -e -c command` started in cwd, as a new user's shell would run it: this environment's python and ruff first
    on PATH, and no $PPG_RELEASED_CODE."""
    env = {k: v for k, v in os.environ.items() if k != rs.ENV_VAR}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return subprocess.Popen(
        ["bash", "-e", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_rules_leave_out_only_what_they_must():
    """The README has its first-run block, and the commands that finish in seconds (--help, --dry-run,
    --released-only) are run, not left out by a rule written too broadly."""
    assert FIRST_RUN is not None and [c.split()[1] for c in FIRST_RUN.splitlines() if c.startswith("python")] == [
        "ppg_procgen.py",
        "ppg_procgen.py",
        "tools/evaluate.py",
    ]
    quick = [c for c in COMMANDS if re.search(r"--help|--dry-run|--released-only", c)]
    assert quick and all(c in RUN for c in quick), [(c, left_out(c)) for c in quick]


def test_the_readme_first_run_trains_resumes_and_evaluates_as_written(checkout):
    """The README's first-run block, as one shell script, in the fresh copy holding an earlier run's folder of the same
    name (a rerun of the block): it trains, resumes its own run from its checkpoint to a raised budget, and evaluates
    that policy."""
    (checkout / "runs" / "starpilot__first__1__1000").mkdir(parents=True)  # the first try's run, older
    done = shell(FIRST_RUN, checkout)
    stdout, stderr = done.communicate(timeout=PATIENCE_S)
    assert done.returncode == 0, stderr[-3000:]
    assert "rollouts: 3 of 4 envs x 32 steps" in stdout and "aux epoch 2/2" in stdout
    assert "resumed from" in stdout and "phase 3/3 iter 5/5 step 640" in stdout
    assert "step 640" in stdout and "mean return" in stdout
    assert not list((checkout / "runs" / "starpilot__first__1__1000").iterdir())  # the older run left alone


def scores(rows) -> list:
    """Each table row's scores (0.754), leaving out the bounds of intervals ([0.740, 0.767])."""
    return [re.findall(r"\d\.\d{3}", re.sub(r"\[[^]]*\]", "", row)) for row in rows]


def table_rows(text: str, header: str) -> list:
    return text[text.index(header) :].split("\n\n")[0].splitlines()[2:]


def test_the_readme_commands_work_as_written(checkout):
    """Each command of RUN (as adjusted()) exits 0 in the fresh copy. They run side by side, a process each: each
    takes seconds, most of them importing Python modules, and they share nothing. `report.py --released-only` also
    prints the scores of docs/results.md's table of the released runs, row by row."""
    no_released = not (checkout.parent / "phasic-policy-gradient").exists()
    commands = [c for c in RUN if not (no_released and "--released-only" in c)]
    started = {command: shell(adjusted(command), checkout) for command in commands}
    failed = []
    for command, process in started.items():
        stdout, stderr = process.communicate(timeout=PATIENCE_S)
        if process.returncode != 0:
            failed.append(f"{adjusted(command)}\n  exit {process.returncode}: {(stdout + stderr)[-1500:]}")
        elif "--released-only" in command:
            printed = table_rows(stdout, "| experiment | mean normalised score at 100M, a variant each |")
            results = (ROOT / "docs" / "results.md").read_text()
            written = table_rows(results, "| experiment | released runs per variant | mean normalised score at 100M |")
            if scores(written) != scores(printed):
                failed.append(f"{command}\n  printed {scores(printed)}, docs/results.md has {scores(written)}")
    assert not failed, f"{len(failed)} of the README's commands failed:\n" + "\n".join(failed)
    if len(commands) < len(RUN):
        pytest.skip(f"report.py --released-only not run: {rs.released_root()[1]}")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_links_lead_to_a_file_and_heading():
    """Each relative link of the README and of docs/results.md, which the README sends its reader to, names a file of
    the checkout and, after a #, one of its headings: a section moved to docs/ breaks no link."""
    broken = []
    for page in [ROOT / "README.md", ROOT / "docs" / "results.md"]:
        for target in re.findall(r"\]\(([^)]+)\)", page.read_text()):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            headings = (
                re.findall(r"^#+ (.*)$", file.read_text(), re.M) if file.is_file() and file.suffix == ".md" else []
            )
            if not file.exists() or (anchor and anchor not in map(slug, headings)):
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
