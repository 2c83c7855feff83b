"""``hybridtrain gpu-check --rehearse``: on a CPU machine, every step a gpu-check call takes before its first GPU
step, so that the first call on a lent GPU machine does not fail on its install or its launch.

1. ``image-python``: a venv made the way the lent machine's is: its site-packages links this Python's torch,
   torchvision, setuptools and the rest (KINDS.md's list of the image), but no Horovod, cffi, pycparser, DALI or
   hybridtrain, and its ``bin/`` has no ``torchrun``;
2. ``build``: install.sh builds Horovod from the bundle, offline, into its own venv from that Python, as the call
   does: with NCCL for sm_90 wherever nvcc and the NCCL wheel (nvidia-nccl-cu13, torch's) are present, as on the
   lent machine, else with CPU operations;
3. ``engine-checks``: every row's config (the H100 recipe and the row's overrides) loads and passes its engine's
   own checks (the refusals a rank makes once the model is built: ``engine_refusals``);
4. ``command-line``: every row's hybridtrain command parses;
5. ``imports``: what every row imports, in the Python that runs it;
6. ``launch``: each launcher of the rows (``python -m torch.distributed.run`` on 1 and 2 ranks, ``horovodrun``)
   starting ``python -m hybridtrain --help`` on its ranks;
7. ``row-starts``: every row of the lent machine (one GPU, no DALI) started as the call starts it; it passes when
   it is still running after START_S, ends well, or ends on its one-line refusal for want of the GPU this machine
   lacks (``wants_the_gpu``).

The table goes to OUT/rehearsal.md; exit 0 only when every step passed. Run it with the network cut
(``unshare -n``, as root) to rehearse the offline machine.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import site
import subprocess
import sys
import time
import venv
from pathlib import Path

from hybridtrain.errors import UserError
from hybridtrain.files import check_output_dir, write_text_atomically
from hybridtrain.gpucheck.check import (
    WORK,
    check_bundle,
    check_checkout,
    checkout_env,
    last_line,
    run_row,
    start_row,
    stop_group,
)
from hybridtrain.gpucheck.check import build_row as horovod_build_row
from hybridtrain.gpucheck.results import read_text
from hybridtrain.gpucheck.rows import FAIL, GPU_TESTS, PASS, RECIPE, REPO, Pythons, Row, build_rows
from hybridtrain.reports import markdown_table

# what the lent machine's Python lacks (KINDS.md lists its packages: setuptools and wheel among them, which
# inductor's CPU kernels need): links of everything else
IMAGE_LACKS = ["horovod", "horovod-*", "cffi", "cffi-*", "_cffi_backend*", "pycparser", "pycparser-*", "nvidia/dali",
               "nvidia/dali_*", "nvidia_dali*", "hybridtrain*", "__editable__*"]
IMPORTS = {"image": "import torch, torchvision, torch.distributed.run, hybridtrain.engine.loop, "
                    "hybridtrain.perf.step_bench, hybridtrain.perf.max_batch, hybridtrain.gpucheck.resume_check, "
                    "hybridtrain.gpucheck.probe, hybridtrain.distributed.torch_distributed",
           "horovod": "import horovod.torch, hybridtrain.engine.loop, hybridtrain.distributed.horovod, "
                      "hybridtrain.perf.step_bench, pytest"}
STEP_TIMEOUT_S = 300
START_S = 15        # row-starts: a row's command still running after this has started
START_AT_ONCE = 3   # row-starts side by side
REHEARSAL_CC = "90"  # the lent machine's H100/H200
REHEARSAL_BUILD_S = 2400  # the NCCL build on a 2-core CPU machine: about 10 min alone, far more beside other work


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


def row_engine(row: Row) -> str | None:
    return row.argv[row.argv.index("--engine") + 1] if "--engine" in row.argv else None


def engine_refusals(rows: list[Row]) -> dict[str, str]:
    """{row: the line its engine refuses it with}: every row that runs on an engine (``--engine``) has its config,
    the H100 recipe with the row's overrides, loaded and passed through that engine's own ``check_config``, as its
    ranks do once the model is built. A config that does not load is a refusal too."""
    from hybridtrain.config import load_config
    from hybridtrain.distributed.engines import engine_module
    refused = {}
    for row in rows:
        engine = row_engine(row)
        if engine is None:
            continue
        try:
            cfg = load_config(os.path.join(REPO, RECIPE), [row.argv[i + 1] for i, a in enumerate(row.argv)
                                                           if a == "--set"])
            getattr(engine_module(engine), "check_config", lambda cfg: None)(cfg)
        except UserError as exc:
            refused[row.name] = str(exc)
    return refused


CHECKS = ("import json, sys\nfrom hybridtrain.gpucheck.rehearsal import Row, engine_refusals\n"
          "rows = [Row(name, kind, argv) for name, kind, argv in json.loads(sys.argv[1])]\n"
          "refused = engine_refusals(rows)\nfor name, line in refused.items():\n    print(f'{name}: {line}')\n"
          "print(f'{len(rows) - len(refused)} of {len(rows)} rows pass their engine checks')\n"
          "sys.exit(1 if refused else 0)")


def check_engines(rows: list[Row], python: str, out: str, env: dict) -> Row:
    """engine_refusals in that Python (the image's: its torch, the engines' modules)."""
    return step("engine-checks", [python, "-c", CHECKS, json.dumps([[r.name, r.kind, r.argv] for r in rows])], out,
                env)


def start_rows(rows: list[Row], out: str, env: dict) -> Row:
    """Every row's command started as the call starts it (its ``before`` commands not run: they need the GPU's
    data), START_AT_ONCE at a time, each stopped after START_S; see the module's step 7 for what passes."""
    waiting, running, bad, started = [r for r in rows if r.kind != "note"], [], [], 0
    begin = time.monotonic()
    while waiting or running:
        while waiting and len(running) < START_AT_ONCE:
            row = waiting.pop(0)
            trial = Row(f"start-{row.name}", row.kind, row.argv, START_S, env=row.env)
            proc = start_row(trial, out, env, say=lambda line: None)
            if proc is None:
                bad.append(f"{row.name}: {trial.detail}")
            else:
                running.append((row.name, os.path.join(out, f"{trial.name}.log"), proc, time.monotonic()))
        time.sleep(0.2)
        for entry in list(running):
            name, log, proc, since = entry
            rc = proc.poll()
            if rc is None and time.monotonic() - since < START_S:
                continue
            if rc is None:
                stop_group(proc)
            elif rc != 0 and not wants_the_gpu(log):
                bad.append(f"{name}: exit {rc}: {last_line(log, width=300)}")
            running.remove(entry)
            started += 1
    return Row("row-starts", "step", status=FAIL if bad else PASS, seconds=time.monotonic() - begin,
               detail="; ".join(bad)[:1500] if bad else f"{started} rows started (logs start-<row>.log)")


def wants_the_gpu(log: str) -> bool:
    """The row's own one-line refusal (a launcher may prefix it with the rank, and print its own traceback after
    it) says it needs the CUDA GPU this machine lacks: it got as far as its first GPU step."""
    return any("hybridtrain: error:" in line and ("CUDA" in line or "GPU" in line)
               for line in read_text(log).splitlines())


def nccl_build_possible(python: str) -> bool:
    """nvcc on PATH (or /usr/local/cuda's) and the NCCL wheel beside that Python's torch: the lent machine's
    combination, so the rehearsal builds what the call builds."""
    nvcc = shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('nvidia.nccl') else 1)"
    try:
        wheel = subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        wheel = False
    return bool(nvcc) and wheel


PARSE = ("import json, sys\nfrom hybridtrain.cli import build_parser\nbad = []\n"
         "for name, argv in json.loads(sys.argv[1]).items():\n    try:\n        build_parser().parse_args(argv)\n"
         "    except SystemExit:\n        bad.append(name)\n"
         "print('does not parse: ' + ', '.join(bad) if bad else 'every row parses')\nsys.exit(1 if bad else 0)")


def check_command_lines(rows: list[Row], python: str, out: str, env: dict) -> Row:
    """Every row's ``python -m hybridtrain ...`` command parses with today's options (in that Python)."""
    argvs = {r.name: r.argv[r.argv.index("hybridtrain") + 1:] for r in rows
             if "hybridtrain" in r.argv and r.kind not in ("resume", "tests")}
    return step("command-line", [python, "-c", PARSE, json.dumps(argvs)], out, env)


def rehearse(out: str | None, bundle: str | None, venv_dir: str | None = None, say=print) -> int:
    out = os.path.abspath(check_output_dir(out or os.path.join(WORK, "rehearsal"), "--out"))
    bundle = check_bundle(bundle)
    if bundle is None:
        raise UserError("--rehearse needs the bundle: make gpu-bundle (or --bundle DIR)")
    check_checkout()
    os.makedirs(out, exist_ok=True)
    begin = time.monotonic()
    env = checkout_env(dict(os.environ))
    image = linked_venv(os.path.join(out, "image-venv"), IMAGE_LACKS) if not os.path.exists(
        os.path.join(out, "image-venv")) else os.path.join(out, "image-venv", "bin", "python")
    lacks_torchrun = not os.path.exists(os.path.join(os.path.dirname(image), "torchrun"))
    steps = [Row("image-python", "step", status=PASS if lacks_torchrun else FAIL,
                 detail=f"{image}: torch linked; no Horovod, cffi, DALI, hybridtrain or torchrun")]
    cache = os.environ.get("HYBRIDTRAIN_CACHE") or os.path.join(WORK, "cache")
    nccl = nccl_build_possible(image)
    what = f"with NCCL for sm_{REHEARSAL_CC}" if nccl else "with CPU operations (no nvcc or no NCCL wheel here)"
    build = horovod_build_row(os.path.abspath(venv_dir or os.path.join(out, "horovod-venv")), bundle, image,
                              nccl=nccl, cache=cache, cc_list=REHEARSAL_CC if nccl else "", jobs=os.cpu_count())
    build.timeout_s = REHEARSAL_BUILD_S
    say(f"gpu-check --rehearse: building Horovod {what} from {bundle} (log {out}/build.log)")
    steps.append(run_row(build, out, time.monotonic() + build.timeout_s + 60, env, say=say))
    steps[-1].detail = steps[-1].detail or what
    py = Pythons(image, os.path.join(build.env["HYBRIDTRAIN_VENV"], "bin"))
    rows = build_rows(1, out, py, dali=True) + build_rows(2, out, py)
    steps += [check_engines(rows, image, out, env), check_command_lines(rows, image, out, env),
              step("imports-image", [image, "-c", IMPORTS["image"]], out, env),
              step("imports-horovod", [py.hvd("python"), "-c", IMPORTS["horovod"]], out, env),
              step("imports-gpu-tests", [py.hvd("python"), "-m", "pytest", "--collect-only", "-q", "-p",
                                         "no:cacheprovider", *GPU_TESTS], out, env)]
    # the rows' launchers, each starting python -m hybridtrain --help on its ranks
    torch_run = [image, "-m", "torch.distributed.run", "--standalone"]
    steps += [step("launch-torch-1rank", [*torch_run, "--nproc-per-node=1", "-m", "hybridtrain", "--help"], out, env),
              step("launch-torch-2ranks", [*torch_run, "--nproc-per-node=2", "-m", "hybridtrain", "--help"], out, env),
              step("launch-horovod-1rank", [py.hvd("horovodrun"), "--gloo", "-np", "1", "-H", "localhost:1",
                                            py.hvd("python"), "-m", "hybridtrain", "--help"], out, env)]
    missing = sorted({r.argv[0] for r in rows if r.argv and not os.access(r.argv[0], os.X_OK)})
    steps.append(Row("row-programs", "step", status=FAIL if missing else PASS,
                     detail=f"missing: {', '.join(missing)}" if missing else "every row's program exists"))
    run_env = {**env, "PATH": py.horovod_bin + os.pathsep + env.get("PATH", "")}
    steps.append(start_rows(build_rows(1, out, py), out, run_env))  # the lent machine's: one GPU, no DALI
    text = markdown_table(["step", "result", "time s", "note"],
                          [[r.name, r.status, f"{r.seconds:.0f}" if r.seconds is not None else "-",
                            r.detail.replace("|", "/")] for r in steps])
    took = f"{len(steps)} steps in {time.monotonic() - begin:.0f} s"
    write_text_atomically(os.path.join(out, "rehearsal.md"), f"# gpu-check rehearsal on {sys.executable}: {took}\n\n"
                                                          f"{text}\n")
    say(text)
    say(f"gpu-check --rehearse: {took}")
    return 0 if all(r.status == PASS for r in steps) else 1
