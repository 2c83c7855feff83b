"""``hybridtrain gpu-check --rehearse``: on a CPU machine, every step a gpu-check call takes before its first GPU
step, so that the first call on a lent GPU machine does not fail on its install or its launch.

1. ``image-python``: a venv made the way the lent machine's is: its site-packages links this Python's torch,
   torchvision and the rest, but no Horovod, cffi, pycparser, setuptools, wheel, DALI or hybridtrain, and its
   ``bin/`` has no ``torchrun``;
2. ``build``: install.sh builds Horovod from the bundle, offline, into its own venv from that Python (CPU
   operations here: the same steps as the GPU build but nvcc's);
3. ``config``: every training row's overrides of the H100 recipe load (hybridtrain.config.load_config);
4. ``command-line``: every row's hybridtrain command parses;
5. ``imports``: what every row imports, in the Python that runs it;
6. ``launch``: each launcher of the rows (``python -m torch.distributed.run`` on 1 and 2 ranks, ``horovodrun``)
   starting ``python -m hybridtrain --help`` on its ranks.

The table goes to OUT/rehearsal.md; exit 0 only when every step passed. Run it with the network cut
(``unshare -n``, as root) to rehearse the offline machine.
"""
from __future__ import annotations

import fnmatch
import json
import os
import site
import sys
import time
import venv
from pathlib import Path

from hybridtrain.errors import UserError
from hybridtrain.gpucheck.check import (
    FAIL,
    PASS,
    WORK,
    check_bundle,
    check_checkout,
    checkout_env,
    last_line,
    run_row,
)
from hybridtrain.gpucheck.check import build_row as horovod_build_row
from hybridtrain.gpucheck.rows import GPU_TESTS, RECIPE, REPO, Pythons, Row, build_rows
from hybridtrain.outputs import check_output_dir, markdown_table

# what the lent machine's Python lacks (KINDS.md): links of everything else
IMAGE_LACKS = ["horovod", "horovod-*", "cffi", "cffi-*", "_cffi_backend*", "pycparser", "pycparser-*", "setuptools",
               "setuptools-*", "_distutils_hack", "distutils-precedence.pth", "pkg_resources", "wheel", "wheel-*",
               "nvidia/dali", "nvidia/dali_*", "nvidia_dali*", "hybridtrain*", "__editable__*"]
IMPORTS = {"image": "import torch, torchvision, torch.distributed.run, hybridtrain.engine.loop, "
                    "hybridtrain.perf.step_bench, hybridtrain.perf.max_batch, hybridtrain.gpucheck.resume_check, "
                    "hybridtrain.gpucheck.probe, hybridtrain.distributed.torch_distributed",
           "horovod": "import horovod.torch, hybridtrain.engine.loop, hybridtrain.distributed.horovod, "
                      "hybridtrain.perf.step_bench, pytest"}
STEP_TIMEOUT_S = 300


def linked_venv(root: str, excluded: list[str]) -> str:
    """A real venv whose site-packages links every entry of this Python's except ``excluded`` (paths relative
    to site-packages, globs allowed, e.g. 'nvidia/dali'): importing those genuinely fails there. Its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    ours = next(p for p in site.getsitepackages() if p.endswith("site-packages"))
    target = next(Path(root).glob("lib/python*/site-packages"))

    def link(rel: str) -> None:
        for entry in os.listdir(os.path.join(ours, rel)):
            path = os.path.join(rel, entry) if rel else entry
            if any(fnmatch.fnmatch(path, pattern) for pattern in excluded):
                continue
            if any(pattern.startswith(path + "/") for pattern in excluded):
                (target / path).mkdir()
                link(path)
            else:
                os.symlink(os.path.join(ours, path), target / path)
    link("")
    return str(Path(root) / "bin" / "python")


def step(name: str, argv: list[str], out: str, env: dict, timeout: float = STEP_TIMEOUT_S) -> Row:
    """One rehearsal step as a real process, judged by its exit status (its output in OUT/<name>.log)."""
    row = Row(name, "step", argv, timeout)
    run_row(row, out, time.monotonic() + timeout + 60, env, say=lambda line: None)
    if row.status != PASS:
        row.detail = row.detail or last_line(os.path.join(out, f"{name}.log"))
    return row


def check_configs(rows: list[Row], python: str, out: str, env: dict) -> Row:
    """Every training row's overrides load in that Python (a refusal there would end the row at once)."""
    sets = {r.name: [r.argv[i + 1] for i, a in enumerate(r.argv) if a == "--set"] for r in rows
            if r.kind in ("train", "resume")}
    code = ("import json, sys\nfrom hybridtrain.config import load_config\nfor name, sets in json.loads(sys.argv[1])"
            ".items():\n    load_config(sys.argv[2], sets)\nprint('ok', len(json.loads(sys.argv[1])))")
    return step("config", [python, "-c", code, json.dumps(sets), os.path.join(REPO, RECIPE)], out, env)


PARSE = ("import json, sys\nfrom hybridtrain.cli import build_parser\nbad = []\n"
         "for name, argv in json.loads(sys.argv[1]).items():\n    try:\n        build_parser().parse_args(argv)\n"
         "    except SystemExit:\n        bad.append(name)\n"
         "print('does not parse: ' + ', '.join(bad) if bad else 'every row parses')\nsys.exit(1 if bad else 0)")


def check_command_lines(rows: list[Row], python: str, out: str, env: dict) -> Row:
    """Every row's ``python -m hybridtrain ...`` command parses with today's options (in that Python)."""
    argvs = {r.name: r.argv[r.argv.index("hybridtrain") + 1:] for r in rows
             if "hybridtrain" in r.argv and r.kind not in ("resume", "tests")}
    return step("command-line", [python, "-c", PARSE, json.dumps(argvs)], out, env)


def launches(py: Pythons) -> dict:
    """The rows' launchers, each starting ``python -m hybridtrain --help`` on its ranks."""
    torch_run = [py.image, "-m", "torch.distributed.run", "--standalone"]
    return {"launch-torch-1rank": [*torch_run, "--nproc-per-node=1", "-m", "hybridtrain", "--help"],
            "launch-torch-2ranks": [*torch_run, "--nproc-per-node=2", "-m", "hybridtrain", "--help"],
            "launch-horovod-1rank": [py.hvd("horovodrun"), "--gloo", "-np", "1", "-H", "localhost:1",
                                     py.hvd("python"), "-m", "hybridtrain", "--help"]}


def rehearse(out: str, bundle: str | None, venv_dir: str | None = None, say=print) -> int:
    out = os.path.abspath(check_output_dir(out, "--out"))
    bundle = check_bundle(bundle)
    if bundle is None:
        raise UserError("--rehearse needs the bundle: make gpu-bundle (or --bundle DIR)")
    check_checkout()
    os.makedirs(out, exist_ok=True)
    env = checkout_env(dict(os.environ))
    image = linked_venv(os.path.join(out, "image-venv"), IMAGE_LACKS) if not os.path.exists(
        os.path.join(out, "image-venv")) else os.path.join(out, "image-venv", "bin", "python")
    lacks_torchrun = not os.path.exists(os.path.join(os.path.dirname(image), "torchrun"))
    steps = [Row("image-python", "step", status=PASS if lacks_torchrun else FAIL,
                 detail=f"{image}: torch linked; no Horovod, cffi, setuptools, DALI, hybridtrain or torchrun")]
    cache = os.environ.get("HYBRIDTRAIN_CACHE") or os.path.join(WORK, "cache")
    build = horovod_build_row(os.path.abspath(venv_dir or os.path.join(out, "horovod-venv")), bundle, image,
                              nccl=False, cache=cache)
    say(f"gpu-check --rehearse: building Horovod from {bundle} (log {out}/build.log)")
    steps.append(run_row(build, out, time.monotonic() + build.timeout_s + 60, env, say=say))
    py = Pythons(image, os.path.join(build.env["HYBRIDTRAIN_VENV"], "bin"))
    rows = build_rows(1, out, py, dali=True) + build_rows(2, out, py)
    steps += [check_configs(rows, image, out, env), check_command_lines(rows, image, out, env),
              step("imports-image", [image, "-c", IMPORTS["image"]], out, env),
              step("imports-horovod", [py.hvd("python"), "-c", IMPORTS["horovod"]], out, env),
              step("imports-gpu-tests", [py.hvd("python"), "-m", "pytest", "--collect-only", "-q", "-p",
                                         "no:cacheprovider", *GPU_TESTS], out, env)]
    steps += [step(name, argv, out, env) for name, argv in launches(py).items()]
    missing = sorted({r.argv[0] for r in rows if r.argv and not os.access(r.argv[0], os.X_OK)})
    steps.append(Row("row-programs", "step", status=FAIL if missing else PASS,
                     detail=f"missing: {', '.join(missing)}" if missing else "every row's program exists"))
    text = markdown_table(["step", "result", "time s", "note"],
                          [[r.name, r.status, f"{r.seconds:.0f}" if r.seconds is not None else "-",
                            r.detail.replace("|", "/")] for r in steps])
    with open(os.path.join(out, "rehearsal.md"), "w") as fh:
        fh.write(f"# gpu-check rehearsal on {sys.executable}\n\n{text}\n")
    say(text)
    return 0 if all(r.status == PASS for r in steps) else 1
