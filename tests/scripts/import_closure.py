"""import_closure.py LABEL ARGS...: ``hybridtrain ARGS`` in this process; at its exit, LABEL-PID.json maps every module
it imported from the checkout (the package, and anything beside it) to its file. The train rank's closure test
(tests/test_torch_engine.py) launches the ranks through it."""
import atexit
import json
import os
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dump(label: str) -> None:
    files = {name: getattr(m, "__file__", None) for name, m in list(sys.modules.items())}
    # a real file (torch.ops names a relative one), not this script, nor a library of a venv made in the checkout
    # (make test's .venv: site-packages lies under it)
    libraries = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    mods = {name: f for name, f in files.items()
            if f and os.path.isabs(f) and f.startswith(CHECKOUT + os.sep) and f != os.path.abspath(__file__)
            and not os.path.realpath(f).startswith(libraries)}
    path = f"{label}-{os.getpid()}.json"
    with open(path + ".tmp", "w") as fh:
        json.dump(mods, fh)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.path.pop(0)  # as the console script: this folder's scripts are not modules of the run
    atexit.register(dump, sys.argv[1])
    from hybridtrain.cli import main
    sys.exit(main(sys.argv[2:]))
