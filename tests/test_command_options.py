"""Every fix a line names exists: the options a refusal or a hint names are options of a command that takes them.
A scan of the package's source against the parsers the CLI really builds: each command's handler names only its own
options (or another command's, naming that command), and every refusal anywhere names an option of some hybridtrain
command, of the module's own parser, or of the launcher or tool its fix runs."""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import textwrap

from conftest import REPO

from hybridtrain.cli import build_parser

OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# the options of the launchers and tools that refusals tell users to run (horovodrun, torchrun, srun, convmv, pip);
# each is checked against its tool's own usage by hand, and listed once
TOOLS = {"--gloo", "--min-np", "--max-np", "--host-discovery-script", "--nproc-per-node", "--max-restarts", "--mpi",
         "--gpus-per-task", "--notest", "--timeline-filename"}
REFUSALS = ("UserError", "ArgumentTypeError", "error", "not_an_engine")


def commands() -> dict[str, set[str]]:
    """'train' -> its options, 'prepare-data digits' -> its options, ...: walked from the CLI's real parser."""
    found = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    path = f"{name} {sub_name}".strip()
                    found[path] = {o for a in sub._actions for o in a.option_strings}
                    walk(sub, path)
    walk(build_parser(), "")
    return found


def handlers() -> dict:
    """Each command's handler (set_defaults(func=...)) -> the commands it serves."""
    served: dict = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    path = f"{name} {sub_name}".strip()
                    if sub.get_default("func") is not None:
                        served.setdefault(sub.get_default("func"), []).append(path)
                    walk(sub, path)
    walk(build_parser(), "")
    return served


def strings(tree: ast.AST) -> list[str]:
    """The literal text of ``tree``'s strings, an f-string's literal parts joined."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value for v in node.values if isinstance(v, ast.Constant)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def test_each_commands_handler_names_only_options_that_command_takes():
    options = commands()
    wrong = []
    for func, served in handlers().items():
        own = set().union(*(options[c] for c in served))
        for text in strings(ast.parse(textwrap.dedent(inspect.getsource(func)))):
            for option in OPTION.findall(text):
                others = [c for c in options if c not in served and f"{c} " in text and option in options[c]]
                if option not in own and not others:
                    wrong.append((served, option, text[:80]))
    assert not wrong, wrong


def test_every_refusal_names_an_option_that_exists():
    """The refusals of the whole package (UserError, argparse's, the plugin check's): each option they name is a
    hybridtrain command's, the option of the parser the module itself builds (a tool run as python -m), or a
    launcher's or tool's of TOOLS."""
    known = set().union(*commands().values()) | TOOLS
    wrong = []
    package = os.path.join(REPO, "hybridtrain")
    for root, _, files in os.walk(package):
        for name in (n for n in files if n.endswith(".py")):
            path = os.path.join(root, name)
            tree = ast.parse(open(path).read())
            own = {s for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and getattr(node.func, "attr", None) == "add_argument" for s in strings(node)}
            for node in ast.walk(tree):
                called = getattr(node, "func", None)
                if isinstance(node, ast.Call) and getattr(called, "id", getattr(called, "attr", None)) in REFUSALS:
                    for option in {o for text in strings(node) for o in OPTION.findall(text)}:
                        if option not in known and option not in own:
                            wrong.append((os.path.relpath(path, REPO), node.lineno, option))
    assert not wrong, wrong


def test_the_scan_sees_a_wrong_option():
    """The scan itself: an option no command takes is found in a refusal's text."""
    tree = ast.parse('raise UserError(f"drop --no-such-option, or --config {x}")')
    found = {o for node in ast.walk(tree) if isinstance(node, ast.Call) for t in strings(node)
             for o in OPTION.findall(t)}
    assert found == {"--no-such-option", "--config"}
    assert "--no-such-option" not in set().union(*commands().values()) and "--config" in commands()["train"]
