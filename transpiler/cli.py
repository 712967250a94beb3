"""What the command-line tools share: a program loaded from ``FILE.py:FUNC``, the config's flags and
reference.

Command-line tools (``python -m transpiler show``, ``ps-server``) take the user's program as a
``FILE.py:FUNC`` or ``package.module:FUNC`` reference (FUNC is called with no arguments and must return a
:class:`Program`), and every :class:`DistributeTranspilerConfig` field as a flag. ``python -m transpiler
config-reference`` prints docs/configuration.md: the fields' types and defaults read from the dataclasses,
their meanings from the dataclasses' docstrings, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
from typing import Dict

from .config import NONFINITE_GRADS, SPLIT_METHODS, TENSORBOARD_TRAINERS, DistributeTranspilerConfig
from .lifecycle import TableLifecycle
from .program import Program


def load_program(ref: str) -> Program:
    """Import ``ref`` (``path/to/file.py:func`` or ``pkg.mod:func``) and return ``func()``."""
    target, sep, func_name = ref.rpartition(":")
    if not sep or not target or not func_name:
        raise ValueError(f"program reference {ref!r} must look like FILE.py:FUNC or module:FUNC")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ValueError(f"program file {target!r} does not exist")
        name = "_ps_program_" + os.path.splitext(os.path.basename(target))[0]
        spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"{target} has no callable {func_name!r}")
    program = func()
    if not isinstance(program, Program):
        raise TypeError(f"{ref} returned {type(program).__name__}, not a transpiler.Program")
    return program


CHOICES = {
    "split_method": SPLIT_METHODS,
    "nonfinite_grads": NONFINITE_GRADS,
    "tensorboard_trainers": TENSORBOARD_TRAINERS,
}
# Fields that are None or an int: their flags parse ints.
INT_OR_NONE = (
    "max_staleness",
    "metrics_port",
    "health_port",
    "server_replicas",
    "replica_lease_ttl",
    "tensorboard_every",
)


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_transpile_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--sync_mode`` and one flag per DistributeTranspilerConfig field."""
    parser.add_argument(
        "--sync_mode",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="true: synchronous updates (default); false: asynchronous",
    )
    defaults = DistributeTranspilerConfig()
    for f in dataclasses.fields(DistributeTranspilerConfig):
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            kind = _bool
        elif f.name in INT_OR_NONE:
            kind = int
        elif default is None:
            kind = str
        else:
            kind = type(default)
        parser.add_argument(
            f"--{f.name}",
            type=kind,
            default=default,
            choices=CHOICES.get(f.name),
            help=f"DistributeTranspilerConfig.{f.name} (default {default!r})",
        )


def config_from_args(args: argparse.Namespace) -> DistributeTranspilerConfig:
    """Build the config from flags added by :func:`add_transpile_arguments`."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistributeTranspilerConfig)}
    return DistributeTranspilerConfig(**values)


# A field's entry in its dataclass's docstring: "- ``name``: meaning", continued on indented lines.
_ENTRY = re.compile(r"- ``(\w+)``: (.*)")
_ENV_VAR = re.compile(r"``(PS_[A-Z_]+)``")


def field_docs(cls) -> Dict[str, str]:
    """Each field of dataclass ``cls`` mapped to its meaning, from the list in ``cls``'s docstring.

    ValueError names the fields the list leaves out and the entries that name no field.
    """
    entries: Dict[str, list] = {}
    current = None
    for line in (inspect.getdoc(cls) or "").splitlines():
        match = _ENTRY.match(line)
        if match:
            current = match.group(1)
            entries[current] = [match.group(2)]
        elif current and line.startswith("  ") and line.strip():
            entries[current].append(line.strip())
        else:
            current = None
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in entries]
    unknown = sorted(set(entries) - set(names))
    if missing or unknown:
        raise ValueError(
            f"{cls.__name__}'s docstring must describe every field and nothing else: "
            f"undocumented {missing}, not fields {unknown}"
        )
    return {n: " ".join(entries[n]) for n in names}


def _type_name(annotation) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    optional = re.fullmatch(r"Optional\[(.+)\]", text)
    return f"{optional.group(1)} or None" if optional else text


def _default_text(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _markdown(text: str) -> str:
    """A docstring's reST as a markdown table cell; ``docs/<page>.md#<anchor>`` becomes a link to it."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", text)
    text = text.replace("``", "`").replace("|", "\\|")
    return re.sub(r"docs/([\w-]+\.md)(#[\w-]+)?", r"[\1\2](\1\2)", text)


def _field_table(cls) -> list:
    docs = field_docs(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        rows.append(
            f"| `{f.name}` | {_type_name(f.type)} | `{_default_text(f)}` | {_markdown(docs[f.name])} |"
        )
    return rows


def config_reference() -> str:
    """docs/configuration.md: every DistributeTranspilerConfig and TableLifecycle field, and the variables
    read.

    Types and defaults come from the dataclasses, meanings from their docstrings (:func:`field_docs`, which
    refuses a field without one); tests/test_docs.py checks the committed file equals this.
    """
    env_rows = ["| variable | field it fills when the field is None |", "|---|---|"]
    for name, doc in field_docs(DistributeTranspilerConfig).items():
        env_rows += [f"| `{var}` | `{name}` |" for var in dict.fromkeys(_ENV_VAR.findall(doc))]
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m transpiler config-reference > docs/configuration.md` from the",
        "     dataclasses in transpiler/config/fields.py and transpiler/lifecycle.py: edit their docstrings, "
        "then",
        "     regenerate (tests/test_docs.py fails while this file is stale). -->",
        "",
        "`DistributeTranspilerConfig(...)` is handed to `DistributeTranspiler`; the config travels inside",
        "the plans, so a pserver and its trainers agree on deadlines and chunk sizes without further flags.",
        "`transpile(..., sync_mode=True)`: `True` synchronous, `False` asynchronous. Every field is also a",
        "flag of the same name of `python -m transpiler show` and `ps-server`; `show` prints every block",
        "(param, rows, shape, bytes), the pserver that owns it, and the bytes per pserver, before a job "
        "starts:",
        "",
        "```bash",
        "python -m transpiler show examples/train_mlp.py:build_program \\",
        "    --pservers 127.0.0.1:6170,127.0.0.1:6171 --split_method HashName --slice_var_up true",
        "```",
        "",
        "## DistributeTranspilerConfig",
        "",
        *_field_table(DistributeTranspilerConfig),
        "",
        "## Environment variables",
        "",
        "A field left `None` takes its value from its variable when that is set (`ps-launch` and the cluster",
        "recipes set the hot-standby ones for every role, so one script serves every role):",
        "",
        *env_rows,
        "",
        "## TableLifecycle",
        "",
        "Per distributed table, `TableOptions(lifecycle=TableLifecycle(...))` or a dict of its fields; every",
        "rule is off by default. What the rules do exactly: "
        "[tables.md#table-lifecycle](tables.md#table-lifecycle).",
        "",
        *_field_table(TableLifecycle),
    ]
    return "\n".join(lines) + "\n"
