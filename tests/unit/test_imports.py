"""The package's structure: no module imports another module's ``_private`` names, and the import graph
(lazy imports inside functions included: they hide a cycle rather than remove it) has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "sparklm"


def modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file, resolved to sparklm modules."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("sparklm"):
                continue
            names = [a.name for a in node.names]
            for n in names:  # `from . import checkpoint` imports a module
                if f"{target}.{n}" in known:
                    found.append((f"{target}.{n}", []))
            rest = [n for n in names if f"{target}.{n}" not in known]
            if rest:  # names defined in the module itself (not submodules of a package)
                found.append((target, rest))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("sparklm")]
    return [(t, n) for t, n in found if t in known]


def test_no_module_imports_another_modules_private_names():
    mods = modules()
    bad = [f"{name} imports {n} from {target}" for name, path in mods.items()
           for target, names in imports(name, path, set(mods)) for n in names
           if n.startswith("_") and not n.startswith("__") and target != name]
    assert not bad, bad


def test_the_import_graph_has_no_cycle():
    mods = modules()
    graph = {name: {t for t, _ in imports(name, path, set(mods)) if t != name} for name, path in mods.items()}
    # a package's __init__ is imported with any of its modules; edges into a parent package are fine only
    # when the parent does not import back
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_the_driver_and_the_barrier_task_do_not_import_torch_for_a_run_from_scratch():
    """torch takes ~1 s to import. The driver's checks and memory plan before Spark starts, every task's module (the
    CLI lists their choices), and the modules a Python worker imports to unpickle DDP's barrier task, need none of it
    (the rank process imports it)."""
    import subprocess
    import sys

    code = (
        "import dataclasses, sys\n"
        "from sparklm.config import Config\n"
        "from sparklm.launch import train as run\n"
        "from sparklm.train import memory, resolve\n"
        "from sparklm.strategies import ddp, rounds\n"
        "cfg = Config()\n"
        "resolve.settings(cfg.replace(train=dataclasses.replace(cfg.train, dtype='float32', optimizer='adamw')), 2)\n"
        "memory.scratch_shapes(cfg.model, 4096, 256)\n"
        "run._check_init_from(cfg, None)\n"
        "from sparklm import registry\n"
        "[registry.task(n) for n in registry.TASK_NAMES]  # every task module, read on the driver\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_function_in_src_is_longer_than_80_lines():
    """A function that does not fit a screen does several things: split it (ruff's C901 bounds its branches)."""
    long = []
    for path in sorted((Path(__file__).resolve().parents[2] / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


# The layers, lowest first: a module imports only from its own layer and those below (lazy imports count). The
# registry (sparklm.registry: tasks, strategies, data and label kinds) imports nothing of sparklm and sits at the
# bottom, so everything above consults it; the modules it names are found by name at run time (plugins), never
# imported from below. Each package is whole in its layer, its __init__ included.
LAYERS = [
    ("registry", ["sparklm.registry"]),
    ("base", ["sparklm.version", "sparklm.config", "sparklm.infra"]),
    ("spark platform", ["sparklm.spark"]),
    ("tokens", ["sparklm.data"]),
    ("models", ["sparklm.model"]),
    ("inference", ["sparklm.infer"]),
    ("metrics, report, trackers", ["sparklm.metrics"]),
    ("the loop and its plan", ["sparklm.train"]),
    ("strategies", ["sparklm.strategies"]),
    ("stage drivers", ["sparklm.launch"]),
    ("tasks", ["sparklm.tasks"]),
    ("entry points", ["sparklm", "sparklm.__main__", "sparklm.cli", "sparklm.api", "sparklm.ml"]),
]


def layer(module: str) -> int:
    """The layer of ``module``: the most specific prefix that names it (a registry package's modules are above it)."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = module.startswith(p) if p.endswith(".") else module == p or module.startswith(p + ".")
            if hit and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def test_no_module_imports_from_a_layer_above_its_own():
    mods = modules()
    upward = [f"{name} ({LAYERS[layer(name)][0]}) imports {target} ({LAYERS[layer(target)][0]})"
              for name, path in mods.items() for target, _ in imports(name, path, set(mods))
              if layer(target) > layer(name)]
    assert not upward, "\n".join(upward)


# What runs on the workers (a DDP rank, a round's task) and what only the driver may run: the resolver, the budget fit
# and the launchers decide; a worker reads its run plan and decides nothing.
WORKER_CODE = ["sparklm.train.core", "sparklm.train.loop", "sparklm.strategies.ddp_rank", "sparklm.strategies.round_worker"]
DRIVER_ONLY = ["sparklm.train.resolve", "sparklm.train.budget", "sparklm.train.peak", "sparklm.launch"]


def reachable(roots: list[str]) -> set[str]:
    """Every sparklm module that importing ``roots`` can import (lazy imports included; a module's packages too)."""
    mods = modules()
    graph = {name: {t for t, _ in imports(name, path, set(mods))} for name, path in mods.items()}
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + sorted(graph.get(name, ()))
    return seen


def test_no_resolver_is_reachable_from_worker_code():
    """The run plan is the only truth on a worker: no module a rank or a round task can import reaches the resolver,
    the budget fit, a benchmark of the machine (peak.py: the CPU's matmul peak, which the plan carries) or a
    launcher."""
    found = sorted(m for m in reachable(WORKER_CODE) if any(m == d or m.startswith(d + ".") for d in DRIVER_ONLY))
    assert not found, found
    assert "sparklm.train.resolve" in reachable(["sparklm.launch.train"])  # the check sees what the driver reaches


def test_every_transformers_load_refuses_remote_code():
    """SECURITY.md says `trust_remote_code=False` on every load: the MLflow tracker's pipelines and the GGUF import
    left it to transformers' default (which asks on a terminal, and whose default may change)."""
    missing = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        literals = {}  # name -> the keys of a dict literal assigned to it (kwargs built before the call)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                if isinstance(target, ast.Name):
                    literals[target.id] = {ast.unparse(k): ast.unparse(v) for k, v in
                                           zip(node.value.keys, node.value.values, strict=True) if k is not None}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if func.rsplit(".", 1)[-1] not in ("from_pretrained", "pipeline") or func.startswith("PeftModel"):
                continue  # peft's loader reads adapter weights and config, no code
            given = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    given.update({n.strip("'\""): v for n, v in literals.get(k.value.id, {}).items()})
            if given.get("trust_remote_code") != "False":
                missing.append(f"{path.relative_to(SRC)}:{node.lineno} {func}")
    assert not missing, missing
