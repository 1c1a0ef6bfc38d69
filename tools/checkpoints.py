"""Which script wrote a checkpoint, where that script is, and the checkpoint's flags as the current version takes them.

A checkpoint names the file that wrote it (`script`: ppg_procgen.py, ppg_atari.py, or a copy of either under another
name, such as ppg_procgen_vlam.py) and which of the two that file is or was copied from (`base_script`). A checkpoint
written before `base_script` was recorded has it told from the file's name. A flag that a later version of a script
fixed at the one value older versions ran with is in that script's RETIRED_FLAGS: a checkpoint holding it at that value
is read without it, and one holding it at another value describes a run that this version cannot make."""

import importlib.util
import pathlib
import sys
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ("ppg_procgen.py", "ppg_atari.py")


def base_script(state: dict) -> Optional[str]:
    """The one of SCRIPTS that the checkpoint's script is or was copied from, or None where that cannot be told."""
    if state.get("base_script") in SCRIPTS:
        return state["base_script"]
    script = str(state.get("script"))
    # a checkpoint written before base_script was recorded: a copy keeps its original's name as the start of its own
    derived = [name for name in SCRIPTS if script.startswith(name.removesuffix(".py"))]
    return derived[0] if len(derived) == 1 else None


def find_script(script: str, checkpoint: str, given: Optional[str] = None) -> Optional[pathlib.Path]:
    """The file of the script that wrote a checkpoint, or None: `given` (a path); for ppg_procgen.py and ppg_atari.py,
    the repository's; for a copy, the file of that name in the folder the run was started from (the one that holds
    runs/<run_name>/), else in the current folder, else in the repository root."""
    if given:
        return pathlib.Path(given).resolve() if pathlib.Path(given).is_file() else None
    started_in = pathlib.Path(checkpoint).resolve().parent.parent.parent
    folders = [ROOT] if script in SCRIPTS else [started_in, pathlib.Path.cwd(), ROOT]
    return next((folder / script for folder in folders if (folder / script).is_file()), None)


def load_script(path: pathlib.Path):
    """The script at `path` as a module, imported under its own name (tyro reads its flags' help through inspect)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def retired_flags(module) -> dict:
    """The script's retired flags, name -> the value they are fixed at (none in a version from before retired flags,
    or where the script still has the flag)."""
    fields = set(vars(module.Args()))
    return {k: v for k, v in getattr(module, "RETIRED_FLAGS", {}).items() if k not in fields}


def drop_retired(module, flags: dict) -> list:
    """Remove from `flags` each of the script's retired flags that holds the value it is fixed at; return those at
    another value, as '--name value' (left in `flags`)."""
    left = []
    for name, value in retired_flags(module).items():
        if name in flags and flags[name] == value:
            del flags[name]
        elif name in flags:
            left.append(f"--{name.replace('_', '-')} {flags[name]}")
    return left
