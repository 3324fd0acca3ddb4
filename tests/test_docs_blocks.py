"""Issue 52: no block in README.md or docs/ can drift from the program unseen. Every fenced block is one
of: a sample the program printed (``<!-- sample: NAME -->``, tests/test_docs_samples.py regenerates it); a
shell block, each ``gradnan`` call and ``-m gradnan.run`` launch in it parsed by the CLI's own parser;
Python that compiles and whose ``gradnan`` imports exist; JSON or TOML that parses; or text marked for what
it is: ``<!-- checked: TEST -->`` (another test compares it), ``<!-- layout -->`` (a diagram, a file layout
or a synopsis), ``<!-- shown, not regenerated: WHY -->`` (output of a run this suite does not repeat, where
each ``$ gradnan ...`` line still parses, with the value checks that hold on any machine, and an argument
error shown after one is the parser's own). The command lists and the synopsis in cli.md come from the
parser."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import pytest

from gradnan.cli import _parser as cli_parser
from gradnan.cli import interpreter as cli_interpreter
from gradnan.cli import picture_path
from gradnan.commandline import ArgumentError, message_line
from gradnan.config.sources import tomllib  # tomli before Python 3.11
from gradnan.run import _parser as launcher_parser

from .test_docs_samples import PAGES, ROOT, _check

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```$",
                   re.DOTALL | re.MULTILINE)
NOTE = re.compile(r"<!-- (sample: [a-z0-9-]+|checked: (?P<test>tests/\w+\.py)|layout"
                  r"|shown, not regenerated: [^>]+) -->\n *$")
PLACEHOLDER = re.compile(r"<[^<>\n]*>")  # <its arguments>, <rank tag>: one word in a command
COMMAND_LISTS = re.compile(r"`gradnan ([a-z]+(?: \| [a-z]+)+)`")


def _fenced() -> Iterator[Tuple[str, int, str, str, str]]:
    """(page, line, language, body, the text just before the fence) of every fenced block."""
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            indent = len(match.group("indent"))
            body = "".join(line[indent:] + "\n" for line in match.group("body").splitlines())
            yield (page.name, text.count("\n", 0, match.start()) + 1, match.group("lang"), body,
                   text[max(0, match.start() - 300):match.start()])


BLOCKS = list(_fenced())


def _subcommands() -> dict:
    [commands] = [action for action in cli_parser()._actions
                  if isinstance(action, argparse._SubParsersAction)]
    return dict(commands.choices)


def _shell_commands(script: str) -> Iterator[List[str]]:
    """The words of each simple command of a shell block: continuation lines joined, comments dropped,
    ``<placeholders>`` one word, split at ``&&``, ``||``, ``|`` and ``;``."""
    script = PLACEHOLDER.sub("PLACEHOLDER", script.replace("\\\n", " "))
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: List[str] = []
        for word in lexer:
            if set(word) <= set("&|;"):
                yield words
                words = []
            else:
                words.append(word)
        yield words


def _gradnan_calls(words: List[str]) -> Iterator[Tuple[str, List[str]]]:
    """('cli', argv) for a ``gradnan`` console-script call (``.venv/bin/gradnan``, after torchrun's
    ``--no-python`` or srun), ('launcher', argv) for the options before the script of ``-m gradnan.run``."""
    for at, word in enumerate(words):
        if word == "gradnan" or word.endswith("/bin/gradnan"):
            yield "cli", words[at + 1:]
            return
        if word == "-m" and at + 1 < len(words) and words[at + 1] in ("gradnan", "gradnan.run"):
            yield ("cli" if words[at + 1] == "gradnan" else "launcher"), words[at + 2:]
            return


def _structure_only(parser: argparse.ArgumentParser,
                    types: Optional[Tuple[Callable, ...]] = None) -> argparse.ArgumentParser:
    """The parser without its value checks (all of them, or those of ``types``): a pasted command's
    subcommand, flags and their number of values are what a page can get wrong."""
    for action in parser._actions:
        if types is None or action.type in types:
            action.type = None
        for sub in getattr(action, "choices", None) or {}:
            if isinstance(action.choices[sub], argparse.ArgumentParser):
                _structure_only(action.choices[sub], types)
    return parser


# Value checks that read this machine's files: an ``--against`` interpreter, a ``--plot`` file that must not
# be a directory. A page's example ran where its paths existed; here they need not (issue 64: a fresh clone
# failed on ``--against /tmp/stack_before/bin/python``, which only the docs' machine had).
READS_THIS_MACHINE = (cli_interpreter, picture_path)
CHECKS = ("all", "portable", "none")


def _parse(kind: str, argv: List[str], checks: str = "all") -> None:
    """Parse as the program would: with every value check, with those that do not read this machine's
    files (``portable``), or with none."""
    parser = cli_parser() if kind == "cli" else launcher_parser()
    if checks != "all":
        parser = _structure_only(parser, READS_THIS_MACHINE if checks == "portable" else None)
    parser.parse_args(argv)


def _failures(languages: Tuple[str, ...], check: Callable[[str], None]) -> List[str]:
    """'page:line: what failed' for each block in one of ``languages`` that ``check`` raises on: every
    failing block of a kind in one test's message."""
    failed = []
    for page, line, lang, body, _ in BLOCKS:
        if lang in languages:
            try:
                check(body)
            except Exception as error:  # the parser's, ast's, json's or an assertion: each is a drift
                failed.append(f"{page}:{line}: {type(error).__name__}: {error}")
    return failed


def test_every_block_is_a_sample_a_checked_kind_or_marked_for_what_it_is():
    notes = {(page, line): NOTE.search(before) for page, line, lang, _, before in BLOCKS
             if lang not in ("bash", "python", "json", "toml")}
    unmarked = [f"{page}:{line}" for (page, line), note in notes.items() if not note]
    assert not unmarked, ("a text block needs <!-- sample: NAME -->, <!-- checked: TEST -->, <!-- layout --> "
                          f"or <!-- shown, not regenerated: WHY --> just before it: {unmarked}")
    checkers = {note.group("test") for note in notes.values() if note and note.group("test")}
    assert all((ROOT / test).is_file() for test in checkers), checkers


def _commands_parse(body: str) -> None:
    for words in _shell_commands(body):
        for kind, argv in _gradnan_calls(words):
            _parse(kind, argv, checks="none")


def test_every_gradnan_command_in_a_shell_block_parses():
    assert not _failures(("bash",), _commands_parse)


def _dollar_lines(body: str) -> Iterator[Tuple[List[str], str]]:
    """(argv, the line after it) for each ``$ gradnan ...`` line of a text block."""
    lines = body.splitlines() + [""]
    for at, line in enumerate(lines[:-1]):
        if line.startswith("$ "):
            for words in _shell_commands(line[2:]):
                for call in _gradnan_calls(words):
                    if call[0] == "cli":
                        yield call[1], lines[at + 1]


def _shown_commands_parse(body: str) -> None:
    """A shown command parses with every value check that holds on any machine; where the line after it
    is an error the parser raises here, it is that error."""
    for argv, shown in _dollar_lines(body):
        try:
            _parse("cli", argv)
        except ArgumentError as error:
            if shown != message_line(str(error)):
                try:
                    _parse("cli", argv, checks="portable")
                except ArgumentError as portable:
                    raise AssertionError(f"{argv}: the parser says {portable}") from None


def test_each_shown_gradnan_command_parses_or_shows_the_parsers_own_error():
    assert not _failures(("text", "json", ""), _shown_commands_parse)


def _python_checks(body: str) -> None:
    tree = ast.parse(body)  # a snippet's elisions are written `...`, which is Python
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradnan"):
            module = importlib.import_module(node.module)
            assert all(hasattr(module, alias.name) for alias in node.names), node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("gradnan"):
                    importlib.import_module(alias.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "gradnan"):
            assert hasattr(importlib.import_module("gradnan"), node.attr), f"gradnan.{node.attr}"


def test_every_python_block_compiles_and_its_gradnan_names_exist():
    assert not _failures(("python",), _python_checks)


def _json_documents(body: str) -> None:
    """One document, or several one after another (records: JSON lines, wrapped)."""
    text = "\n".join(line for line in body.splitlines() if not line.startswith("$ ")).strip()
    decoder = json.JSONDecoder()
    while text:
        _, end = decoder.raw_decode(text)
        text = text[end:].strip()


def test_every_json_and_toml_block_parses():
    assert not _failures(("json",), _json_documents) + _failures(("toml",), tomllib.loads)


def test_every_list_of_commands_is_the_parsers():
    """README, docs/index.md and cli.md name the subcommands as `gradnan a | b | ...`: all of them, in the
    parser's order (`gradnan batch` among them: the report's Next: tells users to run it)."""
    lists = [(page.name, found) for page in PAGES if page.name != "changes.md"
             for found in COMMAND_LISTS.findall(page.read_text())]
    assert {page for page, _ in lists} >= {"README.md", "index.md", "cli.md"}
    for page, found in lists:
        assert found.split(" | ") == list(_subcommands()), page


def test_the_synopsis_in_cli_md_is_the_parsers_usage(monkeypatch):
    """Each subcommand's usage as ``gradnan <command> -h`` prints it (120 columns), then the launcher's."""
    monkeypatch.setenv("COLUMNS", "120")
    usages = [parser.format_usage() for parser in [*_subcommands().values(), launcher_parser()]]
    _check("cli-usage", "".join(line[len("usage: "):].replace(" [-h]", "") + "\n"
                                for usage in usages for line in usage.splitlines()))


def _outside_the_checkout(text: str) -> bool:
    path = Path(text)
    return path.is_absolute() and ROOT.resolve() not in path.resolve().parents


@pytest.mark.parametrize("world", ["none", "all"])
def test_the_docs_checks_hold_on_a_machine_with_none_or_all_of_the_pages_paths(monkeypatch, world):
    """Issue 64: the pages' checks pass whether the absolute paths their examples name exist here or not
    (a fresh clone has none of them; the machine that made the examples has them all). On the old check,
    ``--against /tmp/stack_before/bin/python`` in capture-replay.md failed where it was absent."""
    real_which = shutil.which

    def which(text, *args, **kwargs):
        if not _outside_the_checkout(text):
            return real_which(text, *args, **kwargs)
        return text if world == "all" else None

    monkeypatch.setattr(shutil, "which", which)
    assert not _failures(("text", "json", ""), _shown_commands_parse)
    assert not _failures(("bash",), _commands_parse)
