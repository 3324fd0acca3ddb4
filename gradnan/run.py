"""Run an unmodified training script with gradnan installed: zero edits to Megatron or the script.

    torchrun --nproc_per_node 8 -m gradnan.run pretrain_gpt.py <its arguments>
    srun python -m gradnan.run pretrain_gpt.py <its arguments>
    python -m gradnan.run --out-dir /shared/gradnan --pre-reduction sync -m my_package.train <args>

gradnan options come from ``GRADNAN_*`` environment variables or from flags placed before the script
(``--out-dir``, ``--pre-reduction``, ... one per ``GradnanConfig`` field; flags win), or a JSON/TOML
file (``--config FILE`` or ``GRADNAN_CONFIG``). ``install()`` runs
first, so it is in place before the script builds its optimizer; then the script runs as ``__main__``
with its own ``sys.argv``. A script that restarts the interpreter on a script (``os.execv*``, as
Megatron-Bridge's benchmark recipes do) restarts it under ``-m gradnan.run`` with the same gradnan
options; one that replaces the process with another program is told, on stderr, that gradnan does not
go with it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import runpy
import shutil
import sys
import traceback
from dataclasses import fields
from typing import Any, Callable, List, Optional, Sequence

from .commandline import OneLineParser, bad_input, boolean, whole_number
from .config import GradnanConfig
from .config.values import parse_patterns
from .errors import INTENDED_STOPS, GradnanError, UsageError


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="gradnan.run", description="Run a training script with gradnan installed.",
        usage="python -m gradnan.run [gradnan options] (SCRIPT | -m MODULE) [script arguments]")
    for spec in fields(GradnanConfig):
        flag = "--" + spec.name.replace("_", "-")
        if spec.type == "bool":
            parser.add_argument(flag, dest=spec.name, type=boolean, metavar="BOOL")
        elif spec.type == "Tuple[str, ...]":
            parser.add_argument(flag, dest=spec.name, type=parse_patterns, metavar="NAME,...")
        else:
            parser.add_argument(flag, dest=spec.name, type=whole_number if spec.type == "int" else str)
    parser.add_argument("--config", dest="config_file", metavar="FILE",
                        help="a JSON or TOML file of gradnan options (like GRADNAN_CONFIG)")
    parser.add_argument("-m", dest="module", help="run a module (like python -m) instead of a script")
    parser.add_argument("target", nargs=argparse.REMAINDER, help="the script and its arguments")
    return parser


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find something to run (its parent packages are imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def main(argv: Optional[List[str]] = None) -> int:
    import gradnan

    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        if not args.module and not args.target:
            raise UsageError("give the training script (or -m MODULE) to run")
        if not args.module and not os.path.isfile(args.target[0]):
            raise UsageError(f"no such script: {args.target[0]}")
        if args.module and not _module_exists(args.module):
            raise UsageError(f"-m {args.module}: no such module (on sys.path from {os.getcwd()})")
        installation = gradnan.install(config_file=args.config_file,
                                       **{spec.name: getattr(args, spec.name)
                                          for spec in fields(GradnanConfig)})
    except GradnanError as exc:
        return bad_input("gradnan.run", exc)
    target = f"-m {args.module}" if args.module else args.target[0]
    argv = sys.argv[1:] if argv is None else argv
    _carry_across_exec(argv[:len(argv) - len(args.target) - (2 if args.module else 0)])
    try:
        _run_target(args)
    except INTENDED_STOPS as exc:
        _print_script_traceback(exc)
        print(f"gradnan.run: gradnan stopped {target} as configured: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        _print_script_traceback(exc)
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        print(f"gradnan.run: the training script {target} failed ({error}); the error is"
              f" the script's own, gradnan only ran it. gradnan's files: {installation.out_dir}",
              file=sys.stderr)
        return 1
    return 0


EXECS = ("execv", "execve", "execvp", "execvpe")  # the os functions that take an argument list


def _carry_across_exec(options: Sequence[str]) -> None:
    """Make the ``os.exec*`` calls of the script keep gradnan: an exec of this interpreter on a script
    runs it under ``-m gradnan.run`` with the launcher's ``options``; an exec of anything else is said on
    stderr (gradnan cannot follow it). Nothing else changes: the exec goes on as the script asked."""
    for name in EXECS:
        setattr(os, name, functools.partial(_exec, getattr(os, name), options))


def _exec(original: Callable[..., Any], options: Sequence[str], file: Any, args: Sequence[Any],
          *rest: Any) -> Any:
    words = [os.fsdecode(word) for word in args]
    program = shutil.which(os.fsdecode(file)) or os.fsdecode(file)
    same_python = os.path.realpath(program) == os.path.realpath(sys.executable)
    if same_python and len(words) > 1 and not words[1].startswith("-"):
        print(f"gradnan.run: the script restarts Python on {words[1]}: gradnan goes with it"
              " (-m gradnan.run)", file=sys.stderr, flush=True)
        return original(file, [words[0], "-m", "gradnan.run", *options, *words[1:]], *rest)
    print(f"gradnan.run: the script replaces this process with {' '.join(words[:3])}: gradnan does not"
          " run in it (launch that under -m gradnan.run, or call gradnan.install() in it)",
          file=sys.stderr, flush=True)
    return original(file, args, *rest)


def _run_target(args: argparse.Namespace) -> None:
    if args.module:
        sys.argv = [args.module, *args.target]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        script, *rest = args.target
        sys.argv = [script, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def _print_script_traceback(exc: BaseException) -> None:
    """The traceback as the script alone would show it (its causes too): the launcher's and runpy's frames
    left out."""
    own = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    report = traceback.TracebackException.from_exception(exc)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack
         if frame.filename not in own and os.path.abspath(frame.filename) not in own])
    print("".join(report.format()), end="", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
