"""The documentation's command lines and environment variables against the code: flags and variables.

README.md, docs/*.md and benchmarks/README.md name flags and variables that the code may rename or
drop; these tests make that drift fail, naming the page, the line and the flag or variable:

- every ``--flag`` on a command line (a line of a code block, or a code span that starts with a
  command) is a flag of the command it follows: ``ps-launch``, ``ps-server``, ``ps-stat``,
  ``ps-checkpoint``, ``ps-certs`` (pyproject.toml's scripts), ``python -m transpiler`` and
  ``python -m benchmarks...``, or, once the line names one, the example script it runs
  (``ps-launch ... examples/train_mlp.py --async``: ``--async`` is the script's);
- a ``--flag`` in prose is one of a command the page names, a configuration field as a flag (what
  ``ps-server`` and ``python -m transpiler show`` take, ``transpiler.cli.add_transpile_arguments``),
  or one of a third-party tool's listed below;
- every environment variable a page names (``PS_*``, ``PADDLE_*``, ``SLURM_*``, the engines' role and
  node variables, and any ``$NAME`` or ``NAME=value``) is read somewhere in the code (its name as a
  string) or is another system's, listed below.

Each command's flags are its own parser's, built by running its ``main`` up to the parse.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

import pytest

from tests.test_docs import BENCHMARK_PAGES, CODE_SPAN, FENCE, PAGES, REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
# Flags of other projects' tools that the pages name in prose, by tool (on their own command lines
# nothing is checked: ``torchrun --nproc-per-node 4 train.py``).
THIRD_PARTY_FLAGS = {
    "etcd": {"--election-timeout", "--heartbeat-interval"},
    "tensorboard": {"--logdir", "--host", "--port"},
    "torchrun": {"--nproc-per-node", "--standalone"},
    "kubectl": {"--load-restrictor"},
    "sbatch": {"--requeue"},
}
# The tools on those command lines: what follows them is theirs, until a script of ours.
THIRD_PARTY_COMMANDS = {
    "torchrun",
    "sbatch",
    "etcd",
    "kubectl",
    "docker",
    "tensorboard",
    "pip",
    "grpc_health_probe",
    "grpcurl",
    "openssl",
    "bash",
    "cd",
    "export",
    "git",
}


# ---- the commands and their flags -------------------------------------------------------------------


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser a command's ``main`` built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def option_strings(parser: argparse.ArgumentParser) -> FrozenSet[str]:
    """Every option string of ``parser`` and of its subcommands' parsers."""
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= option_strings(sub)
    return frozenset(found)


def flags_of_main(main) -> FrozenSet[str]:
    """The flags of the parser ``main`` builds: it runs until it parses, which raises instead."""

    def parsed(self, *args, **kwargs):
        raise _Parsed(self)

    names = ("parse_args", "parse_known_args", "parse_intermixed_args")
    saved = {name: getattr(argparse.ArgumentParser, name) for name in names}
    try:
        for name in names:
            setattr(argparse.ArgumentParser, name, parsed)
        main(["--help"]) if inspect.signature(main).parameters else main()
    except _Parsed as done:
        return option_strings(done.parser)
    finally:
        for name, method in saved.items():
            setattr(argparse.ArgumentParser, name, method)
    raise AssertionError(f"{main.__module__}.main returned without parsing its arguments")


@functools.cache
def entry_points() -> Dict[str, str]:
    """pyproject.toml's scripts: ``ps-launch`` -> ``trainer.launch:main``."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


@functools.cache
def flags(command: str) -> FrozenSet[str]:
    """The flags of one of our commands: an entry point, ``python -m MODULE`` or a script's path."""
    if command in entry_points():
        module, _, function = entry_points()[command].partition(":")
        return flags_of_main(getattr(importlib.import_module(module), function))
    if command.startswith("python -m "):
        module = importlib.import_module(command.removeprefix("python -m "))
        if not hasattr(module, "main"):  # a package run by its __main__
            module = importlib.import_module(module.__name__ + ".__main__")
        return flags_of_main(module.main)
    name = "docs_script_" + re.sub(r"\W", "_", command)
    spec = importlib.util.spec_from_file_location(name, REPO / command)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str((REPO / command).parent))  # an example imports its sibling modules
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str((REPO / command).parent))
    return flags_of_main(module.main)


@functools.cache
def config_flags() -> FrozenSet[str]:
    """The configuration's fields as flags: what every command that takes the configuration takes."""
    from transpiler.cli import add_transpile_arguments

    parser = argparse.ArgumentParser()
    add_transpile_arguments(parser)
    return option_strings(parser) - {"-h", "--help"}


def our_script(token: str) -> Optional[str]:
    """The repository path of a script of ours a command line runs (``examples/train_mlp.py``)."""
    path = token.split(":")[0]
    return path if path.endswith(".py") and (REPO / path).is_file() else None


def our_module(name: str) -> bool:
    return name.split(".")[0] in ("transpiler", "benchmarks", "trainer", "pserver", "psproto")


# ---- where the pages name them ----------------------------------------------------------------------


def lines_of(page: Path) -> Iterator[Tuple[int, str, bool]]:
    """(line, text, is a command line) of the page: a code block's lines (continuations joined, its
    comments prose), and prose, less the code spans that start a command (each a command line)."""
    fenced, pending, start = False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            spans = [m for m in CODE_SPAN.finditer(line) if starts_a_command(m.group(2))]
            yield from ((number, m.group(2), True) for m in spans)
            yield (
                number,
                CODE_SPAN.sub(lambda m: "" if starts_a_command(m.group(2)) else m.group(0), line),
                False,
            )
            continue
        start = start if pending else number
        code, _, comment = re.sub(r"^\s*\$ ", "", line).partition(" #")
        if comment:
            yield number, comment, False
        pending += code
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1] + " "
            continue
        yield start, pending, starts_a_command(pending)
        pending = ""


def head(tokens) -> Tuple[Optional[str], int]:
    """(the command a line runs: ours, ``""`` for another tool's, None for none; the tokens it took)."""
    i = 0
    while i < len(tokens) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[i]):  # VAR=value first
        i += 1
    if i == len(tokens):
        return None, i
    word = tokens[i]
    if word in entry_points():
        return word, i + 1
    if word in ("python", "python3") and i + 1 < len(tokens):
        if tokens[i + 1] == "-m" and i + 2 < len(tokens):
            module = tokens[i + 2]  # benchmarks.<name>: a placeholder, not checked
            return (f"python -m {module}" if our_module(module) and "<" not in module else ""), i + 3
        return (our_script(tokens[i + 1]) or ""), i + 2
    if word in THIRD_PARTY_COMMANDS:
        return "", i + 1
    return None, i


def starts_a_command(text: str) -> bool:
    return head(text.split())[0] is not None


def flags_on_a_command_line(text: str) -> Iterator[Tuple[Optional[str], str]]:
    """(command, flag) for each flag of a command line; command None: not ours to check (the
    flags of a user's ``train.py``, of another tool)."""
    for segment in re.split(r"\s(?:&&|\|\||\||;|&)(?=\s|$)", text):
        tokens = segment.split()
        command, taken = head(tokens)
        current = command or None
        for token in tokens[taken:] if command is not None else ():
            if re.search(r"\.py:\w+$", token):  # FILE.py:FUNC, a program to load, not a script to run
                continue
            if token.endswith((".py", ".sh", ".sbatch")):  # a script: what follows is its own
                current = our_script(token)
                continue
            for match in FLAG.finditer(token):
                yield current, match.group(0)


def command_line_problems(text: str) -> List[str]:
    """What is wrong with the flags of one command line."""
    problems = []
    for command, flag in flags_on_a_command_line(text):
        if command is None:
            continue
        if command.startswith("python -m ") and not runnable(command.removeprefix("python -m ")):
            problems.append(f"{flag}: `{command}` runs no module of ours")
        elif flag not in flags(command):
            problems.append(f"{flag} is not a flag of {command}")
    return problems


def prose_problems(text: str, named: FrozenSet[str]) -> List[str]:
    """What is wrong with the flags a line of prose names, on a page that names the commands ``named``."""
    known = config_flags().union(*THIRD_PARTY_FLAGS.values(), *(flags(c) for c in named))
    return [
        f"{flag} is a flag of no command the page names ({', '.join(sorted(named))}), nor a configuration "
        "field's"
        for flag in FLAG.findall(text)
        if flag not in known
    ]


def commands_named(page: Path) -> FrozenSet[str]:
    """Our commands the page names anywhere: entry points, ``python -m`` modules, scripts with a main."""
    text = page.read_text()
    found = {name for name in entry_points() if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)}
    found |= {f"python -m {m}" for m in re.findall(r"python -m ([\w.]+)", text) if our_module(m)}
    found |= {f"python -m {m}" for m in re.findall(r"(?<![\w/])(benchmarks(?:\.\w+)+)", text)}
    examples = {p.name: f"examples/{p.name}" for p in (REPO / "examples").glob("*.py")}
    scripts = {our_script(path) for path in re.findall(r"(?:examples|benchmarks)/[\w/]+\.py", text)}
    scripts |= {examples[name] for name in re.findall(r"(?<![\w/])(\w+\.py)", text) if name in examples}
    found |= {s for s in scripts if s and "\ndef main(" in (REPO / s).read_text()}
    return frozenset(c for c in found if not c.startswith("python -m ") or runnable(c[len("python -m ") :]))


def runnable(module: str) -> bool:
    """``python -m module`` runs something: a module, or a package with a ``__main__``."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.submodule_search_locations is None:
            return spec is not None
        return importlib.util.find_spec(module + ".__main__") is not None
    except ImportError:
        return False


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES + BENCHMARK_PAGES, ids=page_id)
def test_every_flag_a_page_names_is_a_flag_of_its_command(page):
    named = commands_named(page)
    wrong = [
        f"{page_id(page)}:{number}: {problem}"
        for number, text, is_command in lines_of(page)
        for problem in (command_line_problems(text) if is_command else prose_problems(text, named))
    ]
    assert wrong == [], "flags the commands do not have:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "line, problems",
    [
        ("ps-launch --server_num 2 --worker_num 2 examples/train_mlp.py --async", []),
        ("ps-launch --server_num 2 --async examples/train_mlp.py", ["--async is not a flag of ps-launch"]),
        ("ps-launch --worker_num 2 train.py --anything", []),  # the user's script: its own flags
        ("ps-launch --server-num 2 --trainer_num 2 train.py", []),  # the dash and Paddle spellings
        ("python -m transpiler show examples/train_mlp.py:build_program --k_steps 4", []),
        ("ps-stat --jsn 127.0.0.1:6170", ["--jsn is not a flag of ps-stat"]),
        ("pip install -e . && ps-checkpoint export CKPT OUT --step 3", []),
        ("TRAINING_ROLE=TRAINER torchrun --nproc-per-node 4 train.py --lr 1", []),  # not ours
        (
            "sbatch --nodes=2 deploy/slurm/train.sbatch examples/train_mlp.py --epoch 3",
            ["--epoch is not a flag of examples/train_mlp.py"],
        ),
        (
            "python -m benchmarks.bench_gone --runs 1",
            ["--runs: `python -m benchmarks.bench_gone` runs no module of ours"],
        ),
    ],
)
def test_the_command_line_check_itself(line, problems):
    assert command_line_problems(line) == problems


def test_the_prose_check_itself():
    named = frozenset({"ps-launch", "examples/train_mlp.py"})
    assert (
        prose_problems("`--server_num N`, `--async` after the script, `--k_steps 4`, `--logdir`", named) == []
    )
    assert prose_problems("`--no_such_flag`", named) == [
        "--no_such_flag is a flag of no command the page names (examples/train_mlp.py, ps-launch), nor a "
        "configuration field's"
    ]


# ---- environment variables --------------------------------------------------------------------------

# The variables of our roles and nodes that have no family prefix: what the engines and launchers set
# (docs/operations.md's tables); PS_*, PADDLE_* and SLURM_* are variables wherever a page writes them.
ROLE_VARIABLES = (
    "TRAINING_ROLE",
    "POD_IP",
    "TF_CONFIG",
    "JOB_COMPLETION_INDEX",
    "HOSTNAME",
    "GROUP_RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
)
VARIABLE = re.compile(
    r"(?<![\w$])\$\{?([A-Z_][A-Z0-9_]*)"  # $NAME, ${NAME}
    r"|(?<![\w$-])([A-Z][A-Z0-9_]{2,})=(?!=)"  # NAME=value (not K=4: three characters at least)
    r"|(?<![\w$])((?:PS|PADDLE|SLURM)_(?:[A-Z0-9]+_)*(?:[A-Z0-9]+|\*))(?![\w*])"  # PS_HEALTH_PORT, PS_TLS_*
    r"|(?<![\w$])(" + "|".join(ROLE_VARIABLES) + r")(?!\w)"
)
# Variables of other systems the pages name, which our code need not read: each with its owner. (The
# variables of Slurm, torchrun, Kubernetes and Kubeflow that the pages name are those transpiler.roles
# reads to find a role, so they are checked as ours are.)
THIRD_PARTY_VARIABLES = {
    "PWD": "the shell's working directory",
}
CODE_SUFFIXES = (".py", ".sh", ".sbatch", ".yaml")


@functools.cache
def names_in_the_code() -> FrozenSet[str]:
    """The variable names the repository's code reads or sets: strings in Python (``"PS_METRICS_PORT"``),
    a shell's ``$NAME`` and ``NAME=``, a manifest's ``name: NAME`` (the documentation aside)."""
    files = [REPO / ".ci" / "run", REPO / "deploy" / "Dockerfile"]
    for folder in ("trainer", "pserver", "proto", "transpiler", "examples", "benchmarks", "tests", "deploy"):
        files += [p for p in sorted((REPO / folder).rglob("*")) if p.suffix in CODE_SUFFIXES]
    files.remove(Path(__file__).resolve())  # its own lists name them all
    text = "\n".join(p.read_text() for p in files)
    pattern = "|".join(
        (
            r"""["']([A-Z][A-Z0-9_]*)["']""",
            r"\$\{?([A-Z_][A-Z0-9_]*)",
            r"name: ([A-Z_][A-Z0-9_]*)",
            r"^\s*(?:export\s+)?([A-Z_]\w*)=",
        )
    )
    return frozenset(
        name for match in re.finditer(pattern, text, re.MULTILINE) for name in match.groups() if name
    )


def read_by_the_code(name: str) -> bool:
    """The code names ``name``; a family (``PS_TLS_*``): some variable of it."""
    if name.endswith("*"):
        return any(n.startswith(name[:-1]) for n in names_in_the_code())
    return name in names_in_the_code()


def variables_in(line: str) -> List[str]:
    """Every environment variable a line of a page names."""
    return [next(group for group in match.groups() if group) for match in VARIABLE.finditer(line)]


@pytest.mark.parametrize("page", PAGES + BENCHMARK_PAGES, ids=page_id)
def test_every_variable_a_page_names_is_read_by_the_code(page):
    unread = [
        f"{page_id(page)}:{number}: {name} is read nowhere in the code"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for name in variables_in(line)
        if name not in THIRD_PARTY_VARIABLES and not read_by_the_code(name)
    ]
    assert unread == [], "variables nothing reads:\n" + "\n".join(unread)


@pytest.mark.parametrize(
    "line, names",
    [
        ("`PS_METRICS_PORT` (or `PS_TLS_*`, `PADDLE_*`)", ["PS_METRICS_PORT", "PS_TLS_*", "PADDLE_*"]),
        (
            "TRAINING_ROLE=TRAINER torchrun train.py --dir /ckpt/$SLURM_JOB_ID",
            ["TRAINING_ROLE", "SLURM_JOB_ID"],
        ),
        ("`LOCAL_RANK` of `LOCAL_WORLD_SIZE`, `RANK`", ["LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK"]),
        ("`NOT_SERVING`, `INVALID_ARGUMENT`, GEO at K=4", []),  # gRPC's names, a symbol: no variables
    ],
)
def test_the_variables_a_line_names(line, names):
    assert variables_in(line) == names


def test_what_the_code_reads():
    assert read_by_the_code("PS_METRICS_PORT") and read_by_the_code("PS_TLS_*")
    assert not read_by_the_code("PS_NO_SUCH_VARIABLE") and not read_by_the_code("PS_NO_SUCH_*")
