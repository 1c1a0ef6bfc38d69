"""The two scripts stay parallel: `diff ppg_procgen.py ppg_atari.py` shows env, network and defaults only. Every
top-level definition (function, class, constant) both scripts have is the same text in both, but for those named
below, which differ by design; a fix made to one script only fails here."""

import ast
import sys

from conftest import ROOT

# What each script has alone: its env wrapper, its network, and the definitions they use
ONLY = {
    "ppg_procgen.py": {"ProcgenVecEnv", "ImpalaEncoder", "ResidualBlock", "normed_init_", "PROCGEN_GAMES"}
    | {"TestEnvs", "make_test_envs"},  # Procgen's test envs, on the levels that training does not play
    "ppg_atari.py": {"AtariVecEnv", "NatureEncoder", "orthogonal_init_", "ale_protocol", "AleProtocol"},
}
# Shared names whose text differs by design, and why
DIFFER = {
    "Args": "the env's flags and the defaults",
    "OBS_SHAPE": "the env's frames",
    "NUM_ACTIONS": "the env's action set",
    "ACTIVATION_BYTES": "the network's activations per state, measured for each",
    "BASE_SCRIPT": "the name of each (a copy keeps its original's)",
    "make_plan": "the env flags' checks (Atari's env id; that procgen is installed)",
    "collect_rollout": "Procgen's test envs step beside training",
    "resume_args": "Procgen's runs from before the test envs go on without them",
    "PPGAgent": "the network and its initialisation",
    "main": "the env's construction, and Procgen's test envs",
}


def definitions(name: str) -> dict:
    """Each top-level statement that binds a name, by that name: its source text (decorators included)."""
    source = (ROOT / name).read_text()
    lines, found = source.splitlines(), {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            key = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            key = ",".join(e.id for e in target.elts) if isinstance(target, ast.Tuple) else target.id
            key += "+=" if isinstance(node, ast.AugAssign) else ""
        else:
            continue
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        found[key] = "\n".join(lines[first - 1 : node.end_lineno])
    return found


def test_the_scripts_differ_only_in_env_network_and_defaults():
    procgen, atari = definitions("ppg_procgen.py"), definitions("ppg_atari.py")
    assert set(procgen) - set(atari) == ONLY["ppg_procgen.py"]
    assert set(atari) - set(procgen) == ONLY["ppg_atari.py"]
    differ = sorted(name for name in set(procgen) & set(atari) if procgen[name] != atari[name])
    unexpected = [name for name in differ if name not in DIFFER]
    assert not unexpected, f"the scripts' texts of {unexpected} differ: make the change in both scripts"
    assert differ == sorted(DIFFER), "a definition listed as differing by design is now the same: unlist it"
    assert len(set(procgen) & set(atari)) - len(DIFFER) >= 17  # the rest, shared word for word


# The packages a training run imports: these and the standard library, nothing of tools/ (submitit, rliable, ...)
PACKAGES = {"torch", "numpy", "tyro", "gymnasium", "procgen", "ale_py", "wandb", "gym_notices"}  # gym_notices: gym's


def test_the_scripts_import_only_the_cards_packages():
    for name in ("ppg_procgen.py", "ppg_atari.py"):
        found = set()
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                found.add(node.module)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
                found.add(node.args[0].value)
        third_party = {module.split(".")[0] for module in found} - set(sys.stdlib_module_names)
        assert third_party <= PACKAGES and {"torch", "numpy", "tyro"} <= third_party, (name, sorted(third_party))
