"""The import graph of the package and of the tools beside it (benchmarks/, tools/, install/; every import between
their modules, at module level or inside a function): no cycle, the tools import the package and never the reverse,
and building the command-line parser imports no torch (so `hybridtrain report --help` answers at once)."""
from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys

from hybridtrain.distributed.engines import ENGINES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "hybridtrain")
BESIDE = ("benchmarks", "tools", "install")  # run from the checkout, not shipped in the wheel


def module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def imported_modules(path: str, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, resolving relative imports and ``from . import name``."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


@functools.lru_cache(maxsize=None)
def _graph() -> dict[str, frozenset[str]]:
    paths = [os.path.join(root, f) for tree in (PACKAGE, *(os.path.join(REPO, b) for b in BESIDE))
             for root, _, files in os.walk(tree) for f in files if f.endswith(".py")]
    modules = {module_name(p) for p in paths}
    return {module_name(p): frozenset(imported_modules(p, modules)) for p in paths}


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the package and the tools it imports; read once per test session."""
    return {module: set(imports) for module, imports in _graph().items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as a list of modules, or None (depth-first search with colours)."""
    colour, stack = {}, []

    def visit(node):
        colour[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.rsplit(".", 1)[0] == node or node.startswith(nxt + "."):
                continue  # a package and its own submodules
            if colour.get(nxt) == "grey":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in colour:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        colour[node] = "black"
        return None
    for node in sorted(graph):
        if node not in colour:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "hybridtrain.cli" in graph and graph["hybridtrain.cli"], "the scan found the package's imports"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_building_the_parser_imports_no_torch():
    code = ("import sys; from hybridtrain.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# The README's chain, top floor first: a module imports its own folder and the floors below it, never a floor
# above nor a sibling folder on its own floor. The tools beside the package stand above all of it: their commands,
# the tools, the benchmarks they run, then the job and option helpers every tool shares and the install's plan.
FLOORS = (("tools", "tools.__main__", "tools.cli", "benchmarks.__main__", "benchmarks.cli"),
          ("tools.cluster", "tools.experiments"), ("tools.predict",), ("benchmarks",),
          ("tools.jobs", "tools.options", "install"),
          ("hybridtrain", "hybridtrain.__main__", "hybridtrain.cli"),
          ("hybridtrain.inference",), ("hybridtrain.reports", "hybridtrain.data.prepare"),
          ("hybridtrain.engine",),
          ("hybridtrain.data", "hybridtrain.models", "hybridtrain.optim", "hybridtrain.precision"),
          ("hybridtrain.distributed", "hybridtrain.hardware"), ("hybridtrain.config",), ("hybridtrain.launched_by",),
          ("hybridtrain.files",), ("hybridtrain.errors",))


def home(module: str) -> tuple[int, str]:
    """(floor, folder) of a module: the longest prefix in FLOORS that holds it."""
    found = [(len(p), i, p) for i, floor in enumerate(FLOORS) for p in floor
             if module == p or module.startswith(p + ".")]
    _, floor, folder = max(found)
    return floor, folder


TOPS = (0, FLOORS.index(("hybridtrain", "hybridtrain.__main__", "hybridtrain.cli")))  # the commands' floors


def wrong_way(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    wrong = []
    for module, imports in graph.items():
        floor, folder = home(module)
        for imported in imports:
            their_floor, their_folder = home(imported)
            if their_floor < floor or (their_floor == floor and their_folder != folder and floor not in TOPS):
                wrong.append((module, imported))
    return sorted(wrong)


def test_imports_go_down_the_readme_chain_floor_by_floor():
    """Beside the package: the tools' commands -> cluster (the emulated cluster on one machine), experiments ->
    predict (the cluster model) -> benchmarks -> jobs, options, install (the install's plan). The package: cli ->
    inference (a trained model) -> reports, data.prepare -> engine -> data, models, optim, precision ->
    distributed, hardware (the node checks) -> config -> launched_by (which launcher started this process, and the
    guard that tells it how a command ended) -> files (every write, and the path rules the config's path keys share)
    -> errors: the training code never imports a tool, a report or the command line, and the folders of one floor
    stay apart."""
    graph = import_graph()
    assert {home(m)[1] for m in graph} == {p for floor in FLOORS for p in floor}  # every folder has its floor
    assert wrong_way(graph) == []


def test_the_chain_check_finds_an_upward_and_a_sideways_import():
    graph = {"hybridtrain.engine.loop": {"benchmarks.step_bench", "hybridtrain.engine.epoch"},
             "hybridtrain.optim.factory": {"hybridtrain.precision.scaler", "hybridtrain.errors"},
             "benchmarks.scaling": {"hybridtrain.reports.report", "hybridtrain.engine.loop", "tools.jobs"},
             "tools.jobs": {"benchmarks.scaling"}}
    assert wrong_way(graph) == [("hybridtrain.engine.loop", "benchmarks.step_bench"),
                                ("hybridtrain.optim.factory", "hybridtrain.precision.scaler"),
                                ("tools.jobs", "benchmarks.scaling")]


def test_the_package_imports_nothing_beside_it_and_the_tools_import_the_package():
    """A wheel ships hybridtrain/ alone: an import of benchmarks/, tools/ or install/ from inside it would break the
    installed package. The tools stand on the trainer: each of the three imports it."""
    graph = import_graph()
    inward = sorted((m, i) for m, imports in graph.items() if m.split(".")[0] == "hybridtrain"
                    for i in imports if i.split(".")[0] in BESIDE)
    assert inward == []
    for tree in BESIDE:
        assert any(i.startswith("hybridtrain.") for m, imports in graph.items() if m.split(".")[0] == tree
                   for i in imports), tree
    assert {i.split(".")[0] for i in graph["tools.jobs"]} <= {"hybridtrain"}  # the tools' bottom: no cycle through it
    setup = open(os.path.join(REPO, "setup.py")).read()
    assert 'find_packages(include=["hybridtrain", "hybridtrain.*"])' in setup


def test_the_top_level_holds_five_modules_the_command_line_and_the_config():
    """The package's face and ``python -m hybridtrain``, the errors, every write (and the paths checked before it)
    and which launcher started the process (with the guard) are modules; the command line (cli/: one module per family of commands, on the top floor) and the
    config are folders."""
    top = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "files.py", "launched_by.py"]
    for folder in ("cli", "config"):
        assert os.path.isfile(os.path.join(PACKAGE, folder, "__init__.py")), folder
    assert {m for m in import_graph() if home(m)[0] == TOPS[1]} - {"hybridtrain", "hybridtrain.__main__"} == \
        {module_name(os.path.join(PACKAGE, "cli", f)) for f in os.listdir(os.path.join(PACKAGE, "cli"))
         if f.endswith(".py")}


def test_no_module_calls_anything_at_import():
    """No side effect at import (an exit handler, a signal handler, a thread): no module runs a call at its top
    level, outside ``if __name__ == "__main__"``; such work happens when the code that needs it runs."""
    calls = []
    for root, _, files in os.walk(PACKAGE):
        for f in (f for f in files if f.endswith(".py") and f != "__main__.py"):  # __main__ is run, not imported
            path = os.path.join(root, f)
            for node in ast.parse(open(path).read()).body:
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                    calls.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}")
    assert calls == []


ENGINE_MODULES = tuple(spec.module for spec in ENGINES.values())
# the one place above distributed/ allowed to name Horovod: its elastic loop
NAMES_HOROVOD = ("hybridtrain.engine.elastic",)


def library_imports(path: str) -> set[str]:
    """The top-level and dotted names ``path`` imports from outside the package (horovod.torch, torch.distributed)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_each_engine_stays_behind_the_distributed_face():
    """engine/, models/, precision/, data/ and reports/ call distributed.collectives (and topology, launcher,
    engines); only distributed/ imports an engine module, horovod or torch.distributed (and Horovod's elastic loop)."""
    leaks, graph = [], import_graph()
    for root, _, files in os.walk(PACKAGE):
        for f in (f for f in files if f.endswith(".py")):
            path = os.path.join(root, f)
            name = module_name(path)
            if name.startswith("hybridtrain.distributed") or name in NAMES_HOROVOD:
                continue
            modules = graph[name] | library_imports(path)
            leaks += [f"{name} imports {m}" for m in modules
                      if m in ENGINE_MODULES or m.split(".")[0] == "horovod" or m.startswith("torch.distributed")]
            leaks += [f"{name} calls import_horovod"] if "import_horovod" in open(path).read() else []
    assert leaks == []
    assert "hybridtrain.distributed.collectives" in graph["hybridtrain.engine.trainer"]


def test_the_readme_chain_holds_floor_by_floor():
    """The README's chain, one rule per floor: config imports nothing of the package but itself, files, errors and
    launched_by, and its modules only those below them (sections <- coercion <- rules, paths <- loading <- the
    face); errors imports nothing, files only errors, launched_by only those two; the engine imports no data backend
    (data/loaders is the face); data imports no precision."""
    graph = import_graph()
    backends = {"hybridtrain.data.torchvision_loader", "hybridtrain.data.dali", "hybridtrain.data.synthetic"}
    order = ["sections", "coercion", "rules", "paths", "loading"]
    for module, imports in graph.items():
        if module == "hybridtrain.config" or module.startswith("hybridtrain.config."):
            inside = {i.rpartition(".")[2] for i in imports if i.startswith("hybridtrain.config.")}
            outside = imports - {f"hybridtrain.config.{m}" for m in inside}
            assert outside <= {"hybridtrain.files", "hybridtrain.errors", "hybridtrain.launched_by"}, (module, outside)
            own = module.rpartition(".")[2]
            below = order[:order.index(own)] if own in order else order
            assert inside <= set(below) - ({"rules"} if own == "paths" else set()), (module, inside)
    assert graph["hybridtrain.errors"] == set() and graph["hybridtrain.files"] == {"hybridtrain.errors"}
    assert graph["hybridtrain.launched_by"] == {"hybridtrain.errors", "hybridtrain.files"}
    assert [(m, i) for m, imports in graph.items() if m.startswith("hybridtrain.engine.")
            for i in imports if i in backends] == []
    assert [(m, i) for m, imports in graph.items() if m.startswith("hybridtrain.data.")
            for i in imports if i.startswith("hybridtrain.precision")] == []


def test_loading_a_config_and_reporting_a_run_import_no_torch():
    code = ("import sys; from hybridtrain.config import load_config; load_config('configs/demo.yaml'); "
            "import hybridtrain.reports.report; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(PACKAGE))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_configs_stages_are_the_resnets():
    from hybridtrain.config import STAGES
    from hybridtrain.models.resnet import STAGES as RESNET_STAGES
    assert STAGES == RESNET_STAGES


def test_importing_the_elastic_loop_and_checking_its_config_import_no_horovod():
    """Horovod's elastic State is subclassed on first use (elastic.horovod_elastic_state), not at import."""
    code = ("import sys; from hybridtrain.config import load_config; from hybridtrain.engine import elastic; "
            "from hybridtrain.errors import UserError\n"
            "try: elastic.check_elastic(load_config('configs/demo.yaml'))\n"
            "except UserError as exc: print(str(exc)[:40])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'horovod')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(PACKAGE), env={**os.environ, "HOROVOD_ELASTIC": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# What every command pays before its handler runs: the parser of the package's own commands, no tool and no engine
PARSER_LINES = 1_500


def test_the_parser_loads_only_the_package_commands_modules_within_its_size():
    code = ("import json, sys\nfrom hybridtrain.cli import build_parser\ntry:\n    build_parser().parse_args(['--help'])\n"
            "except SystemExit:\n    pass\nprint(json.dumps({n: m.__file__ for n, m in list(sys.modules.items()) "
            "if n.split('.')[0] in ('hybridtrain',) + " + repr(BESIDE) + "}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "usage: hybridtrain" in out.stdout and "``" not in out.stdout  # the help is plain text
    assert sorted(m for m in loaded if m.split(".")[0] != "hybridtrain" or m.startswith("hybridtrain.distributed")
                  ) == []  # no tool, and --engine's registry only when the option is given
    lines = sum(len(open(f, "rb").read().splitlines()) for f in loaded.values())
    assert lines <= PARSER_LINES, (lines, sorted(loaded))


# Every file of the package is imported by a train rank or serves one of the commands on a run's input or output,
# by the static graph from each command's module (lazy imports included). A new file that serves none of them
# belongs beside the package (benchmarks/, tools/).
COMMAND_ROOTS = {
    "train": ("hybridtrain.cli.train", *ENGINE_MODULES),  # the engines load by name from their registry
    "prepare-data, reorganise-val, check-data": ("hybridtrain.cli.data",),
    "report, plot-schedule, evaluate, classify, export": ("hybridtrain.cli.reports",),
}
ENTRY_POINTS = {"hybridtrain.__main__", "hybridtrain.cli.__main__"}  # python -m hybridtrain, python -m hybridtrain.cli


def served(graph: dict[str, set[str]], roots) -> set[str]:
    """The modules ``roots`` import, directly or not; a module brings its packages' ``__init__`` along."""
    seen, stack = set(), list(roots)
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        stack += graph.get(module, ())
        stack += [module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)]
    return seen


def test_every_file_of_the_package_serves_train_or_a_command_on_a_runs_input_or_output():
    graph = import_graph()
    package = {m for m in graph if m.split(".")[0] == "hybridtrain"}
    reached = served(graph, [r for roots in COMMAND_ROOTS.values() for r in roots])
    assert sorted(package - reached - ENTRY_POINTS) == []
    assert ENTRY_POINTS <= package  # a stale exception fails: delete it
    assert "hybridtrain.engine.elastic" in served(graph, COMMAND_ROOTS["train"])


def test_the_served_check_finds_a_stray_module():
    graph = {"a.cli": {"a.core"}, "a.core": set(), "a.stray": {"a.core"}, "a": set()}
    assert {"a.stray"} == set(graph) - served(graph, ["a.cli"])


def test_every_module_beside_the_package_imports():
    """The graph checks which modules are imported, not the names taken from them: importing each finds a name
    that moved (a tool importing the job helpers from where they were)."""
    modules = sorted(m for m in import_graph() if m.split(".")[0] in BESIDE and not m.endswith("__main__"))
    code = f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
