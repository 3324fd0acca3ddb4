"""The ``gradnan`` command: demo, report, checkpoints, maps, frames, batch, replay, selftest. Bad input: one
line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from . import selftest
from .commandline import OneLineParser, bad_input, positive, printable, say, shell_word, whole_number
from .errors import GradnanError, InputError, UsageError
from .offline.incident.analysis import analyze
from .offline.incident.checkpoints import Save, format_saves, saves_of
from .offline.incident.frames_view import format_frames
from .offline.incident.read import collector_paused, map_params, read_run
from .offline.incident.report import format_text
from .offline.incident.runs import SERIOUS_SKIPS
from .offline.replay.limits import (
    DEFAULT_MAX_CPU_SECONDS,
    DEFAULT_MAX_OPS,
    ReplayLimits,
    byte_size,
    cpu_seconds,
    default_max_memory,
)

DESCRIPTION = ("Forensics for a Megatron-LM run whose grad norm went NaN or Inf: where the value was born"
               " (the rank, the parameter or module, the cause) and what to do next. Start with"
               " 'gradnan report RUN_DIR'. Bad input: one line on stderr, exit code 2.")
SELFTEST = ("Confirm or clear a suspect GPU: every rank checks its arithmetic against the others' and the"
            " collectives between them. Launch it like training, one process per GPU: torchrun"
            " --nproc_per_node=N --no-python gradnan selftest --out RUN_DIR (docs/selftest.md).")


PICTURE_FORMATS = ("png", "svg", "pdf")  # matplotlib's formats that run no other program (not pgf: LaTeX)


def picture_path(text: str) -> Path:
    """An argparse type: a file to draw into, its format named by its suffix (``PICTURE_FORMATS``)."""
    path = Path(text)
    if path.suffix[1:].lower() not in PICTURE_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: the picture's format is its suffix, one of"
                                         f" {', '.join('.' + suffix for suffix in PICTURE_FORMATS)}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: a directory, not a file to draw into")
    return path


MAX_AGAINST = 8  # environments one comparison replays in, one after another


def interpreter(text: str) -> str:
    """An argparse type: a Python interpreter to run, by path or by name on PATH."""
    found = shutil.which(text) if text else None
    if found is None:
        raise argparse.ArgumentTypeError(f"not an executable file or a command on PATH: {text!r}")
    return os.path.abspath(found)  # not resolved: a virtual environment's python is a link out of it


def ulps(text: str) -> int:
    """An argparse type: a whole number of ulps, 0 to 2^30, in ASCII digits."""
    if not (text.isascii() and text.isdigit()) or int(text) > 1 << 30:
        raise argparse.ArgumentTypeError(f"must be a whole number of ulps from 0 to 2^30, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="gradnan", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    demo = commands.add_parser("demo", help="train a tiny Megatron GPT on CPU (2 processes) until a scaled-up"
                               " weight overflows bf16, then report it",
                               description="Train a tiny Megatron-Core GPT on CPU in 2 processes (TP=2, bf16)"
                               " and, at step 2, scale one attention weight up until layer 1's attention"
                               " overflows bf16; then print gradnan's report of it.")
    demo.add_argument("--out", default="gradnan_demo", metavar="DIR",
                      help="run directory to create (default: %(default)s)")
    report = commands.add_parser("report", help="one answer for the whole job from every rank's files")
    report.add_argument("run_dir", type=Path)
    report.add_argument("--json", action="store_true", help="the gradnan.report JSON document")
    report.add_argument("--fp16-skips", type=positive, default=SERIOUS_SKIPS, metavar="N",
                        help="consecutive fp16 loss-scale skips that count as a failure"
                             " (default: %(default)s)")
    report.add_argument("--run", metavar="KEY",
                        help="which launch in RUN_DIR to report (default: the latest that failed)")
    report.add_argument("--plot", type=picture_path, metavar="FILE",
                        help="also draw the failing step (rank x module map) into FILE"
                             " (.png/.svg/.pdf; matplotlib)")
    checkpoints = commands.add_parser("checkpoints", help="every checkpoint saved with gradnan installed:"
                                      " clean or not, and why")
    checkpoints.add_argument("run_dir", type=Path)
    checkpoints.add_argument("--json", action="store_true", help="the saves as a JSON list")
    checkpoints.add_argument("--last", type=positive, metavar="N", default=SAVES_SHOWN,
                             help=f"only the newest N saves (default {SAVES_SHOWN}); how many older ones"
                                  " there are is said")
    maps = commands.add_parser("maps", help="which parameter is id N on a rank")
    maps.add_argument("run_dir", type=Path)
    maps.add_argument("--rank", help="global rank (3) or coordinates (tp1,pp0,dp1)")
    maps.add_argument("--id", type=whole_number, dest="param_id", help="optimizer parameter id from a record")
    maps.add_argument("--json", action="store_true")
    frames = commands.add_parser("frames", help="the forward frames a rank recorded (frame tracing)")
    frames.add_argument("run_dir", type=Path)
    frames.add_argument("--rank", help="global rank (3) or coordinates (tp1,pp0,dp1); default: every rank")
    frames.add_argument("--step", type=whole_number, help="only this step (the records' step)")
    frames.add_argument("--iteration", type=whole_number,
                        help="only this Megatron-LM iteration (as trace_steps counts there)")
    frames.add_argument("--last", type=positive, metavar="N", help="only the last N frames of each record")
    frames.add_argument("--json", action="store_true", help="the frames records as JSON")
    batch = commands.add_parser("batch", help="a micro-batch the rerun kept: its tensors, token ids, text,"
                                " and where the value went non-finite")
    batch.add_argument("file", type=Path, help="a batches/<rank>/<when>_mb<M>.pt file of a run directory")
    batch.add_argument("--tokenizer", help="decode the token ids: a tokenizer.json file (needs the"
                                           " 'tokenizers' package) or a Hugging Face tokenizer name or"
                                           " directory (needs 'transformers')")
    replay = commands.add_parser("replay",
                                 help="rerun a captured module call offline: does the failure reproduce?")
    replay.add_argument("bundle", type=Path, help="a bundle directory written by capture")
    replay.add_argument("--device", help="cpu or cuda[:N] (default: cuda if available)")
    replay.add_argument("--json", action="store_true", help="the gradnan.replay JSON document")
    replay.add_argument("--max-memory", type=byte_size, metavar="SIZE",
                        help="address space the replay may map beyond torch's own (8G, 512M; default:"
                             " a quarter of this machine's memory)")
    replay.add_argument("--max-cpu-seconds", type=cpu_seconds, default=DEFAULT_MAX_CPU_SECONDS, metavar="N",
                        help="CPU time of the replay, all threads, at most a day (default: %(default)s)")
    replay.add_argument("--max-ops", type=positive, default=DEFAULT_MAX_OPS, metavar="N",
                        help="operators one forward or backward pass may run (default: %(default)s)")
    replay.add_argument("--against", type=interpreter, action="append", metavar="PYTHON",
                        help="replay under this Python interpreter (another virtual environment, another"
                             " torch) and compare op by op with the capture; twice or more: with each"
                             " other too (docs/capture-replay.md#which-change-broke-numerics)")
    replay.add_argument("--ulps", type=ulps, metavar="N",
                        help="with --against: outputs within N ulps of their dtype count as the same"
                             " (default: bitwise)")
    replay.add_argument("--nan-patterns", action="store_true",
                        help="with --against: outputs whose NaNs alone differ in their bit patterns (sign,"
                             " payload) count as different (default: reported, not counted)")
    selftest.add_arguments(commands.add_parser(
        "selftest", help="cross-rank self-test of communication and arithmetic (launch like training)",
        description=SELFTEST))
    return parser


def _matches_rank(coords: Dict[str, Any], wanted: str) -> bool:
    if wanted.isdigit():
        return coords.get("global_rank") == int(wanted)
    for token in wanted.replace("_", ",").replace("-", ",").split(","):
        axis = token.rstrip("0123456789")
        number = token[len(axis):]
        if not axis or not number or str(coords.get(axis)) != number:
            return False
    return True


def _maps_command(args: argparse.Namespace) -> List[Dict[str, Any]]:
    chosen, rows = map_params(args.run_dir,
                              lambda header: args.rank is None or _matches_rank(header["rank"], args.rank),
                              lambda entry: args.param_id is None or entry["id"] == args.param_id)
    if not chosen:
        raise InputError(f"{args.run_dir}: no map for rank {args.rank!r}")
    if args.param_id is not None and not rows:
        raise InputError(f"{args.run_dir}: no parameter with id {args.param_id} on rank {args.rank!r}")
    return rows


def _frames_command(args: argparse.Namespace) -> List[Dict[str, Any]]:
    files = read_run(args.run_dir)
    chosen = [record for record in files.all_records() if record.get("kind") == "frames"
              and (args.rank is None or _matches_rank(record["rank"], args.rank))
              and (args.step is None or record["step"] == args.step)
              and (args.iteration is None or record.get("iteration") == args.iteration)]
    if not chosen:
        wanted = " and ".join(text for text in (args.rank and f"rank {args.rank}",
                                                 args.step is not None and f"step {args.step}",
                                                 args.iteration is not None and f"iteration {args.iteration}")
                              if text)
        raise InputError(f"{args.run_dir}: no frames recorded{' for ' + wanted if wanted else ''}"
                        " (frame tracing is on with frames=detect or frames=trace)")
    return sorted(chosen, key=lambda r: (r["step"], r["rank"]["global_rank"]))


SAVES_SHOWN = 100  # saves ``gradnan checkpoints`` lists by default (a run directory may hold 50,000)


def _checkpoints_command(args: argparse.Namespace) -> List[Save]:
    """The newest ``--last`` saves; how many older ones were left out is said on stderr (with --json) or
    on the listing's first line."""
    saves = saves_of(read_run(args.run_dir).all_records())
    if not saves:
        raise InputError(f"{args.run_dir}: no checkpoint marks (a checkpoint is marked when it is saved with"
                         " gradnan installed, its patch 'checkpoint' on)")
    older = len(saves) - args.last
    if older > 0:
        note = f"{older} older save(s) not shown: --last {len(saves)} lists them all"
        if args.json:
            print(note, file=sys.stderr)
        else:
            say(f"({note})")
    return saves[-args.last:]


def _compare_command(args: argparse.Namespace, limits: ReplayLimits) -> str:
    """``gradnan replay BUNDLE --against PYTHON...``: each replay in turn, then the comparison."""
    from .offline.replay.comparison import capture_versions, compare, format_comparison
    from .offline.replay.isolation import replay_under

    if len(args.against) > MAX_AGAINST:
        raise UsageError(f"--against: at most {MAX_AGAINST} environments in one comparison")
    replays = [replay_under(python, args.bundle, args.device, limits) for python in args.against]
    document = compare(replays, capture_versions(args.bundle), args.device, args.ulps, args.nan_patterns)
    return json.dumps(document, indent=1) if args.json else format_comparison(document)


def _print_maps(rows: Iterable[Dict[str, Any]]) -> None:
    """One line per parameter, each escaped whole (a name with a newline stays on its line), as the rows
    come (a map of a million rows is never held as text)."""
    listed = False
    for row in rows:
        shard = f" shard {row['shard']}" if row.get("shard") else ""
        say(printable(f"rank {row['rank']} id {row['id']}: {row['name']} {row.get('shape')}"
                      f" {row.get('dtype')}{shard}"))
        listed = True
    if not listed:
        say("the selected map(s) list no parameters (a rank whose optimizer steps none)")


def main(argv: Optional[List[str]] = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # text from a file that UTF-8 cannot encode: escaped, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        args = _parser().parse_args(argv)
        if args.command == "demo":
            from .testing.demo import run_demo

            say(run_demo(Path(args.out)))
        elif args.command == "report":
            with collector_paused():
                report = analyze(read_run(args.run_dir, params=False), serious_skips=args.fp16_skips,
                                 run=args.run)
            if args.plot and report.incident is not None:
                from .offline.incident.plot import plot_incident

                plot_incident(report, args.plot)
            say(json.dumps(report.to_json(), indent=1) if args.json else format_text(report))
            if args.plot and not args.json:
                say(f"Picture: {shell_word(args.plot)}" if report.incident is not None
                    else "Nothing to plot: no failing step.")
        elif args.command == "replay":
            from .offline.replay.isolation import replay_isolated
            from .offline.replay.text import format_text as replay_text

            limits = ReplayLimits(max_memory=args.max_memory or default_max_memory(),
                                  max_cpu_seconds=args.max_cpu_seconds, max_ops=args.max_ops)
            if args.against:
                say(_compare_command(args, limits))
            elif args.ulps is not None or args.nan_patterns:
                option = "--ulps" if args.ulps is not None else "--nan-patterns"
                raise UsageError(f"{option} compares replays: give it with --against PYTHON")
            else:
                result = replay_isolated(args.bundle, args.device, limits)
                say(json.dumps(result, indent=1) if args.json else replay_text(result))
        elif args.command == "batch":
            from .offline.incident.batch_view import format_batch

            say(format_batch(args.file, args.tokenizer))
        elif args.command == "selftest":
            return selftest.run(args)
        elif args.command == "frames":
            chosen = _frames_command(args)
            if args.json:
                say(json.dumps(chosen, indent=1))
            else:
                say("\n\n".join(format_frames(record, args.last) for record in chosen))
        elif args.command == "checkpoints":
            saves = _checkpoints_command(args)
            say(json.dumps([save.to_json() for save in saves], indent=1) if args.json
                else format_saves(saves))
        elif args.command == "maps":
            rows = _maps_command(args)
            if args.json:
                say(json.dumps(rows, indent=1))
            else:
                _print_maps(rows)
    except GradnanError as exc:
        return bad_input("gradnan", exc)
    except BrokenPipeError:  # `gradnan maps ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
