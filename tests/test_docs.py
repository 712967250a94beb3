"""The documentation against the code: links, named paths and names, the generated reference, length.

README.md, docs/*.md and benchmarks/README.md may drift from the code as it changes; these tests
make the drift fail: every relative link reaches a file (and its ``#anchor`` a heading there, by
GitHub's slug rules), every repository path a page mentions exists, every dotted name it writes in
backticks (``trainer.PserverError``, ``Trainer.step``, ``TableSet.apply_mean``) resolves by import
and getattr, docs/configuration.md is what ``python -m transpiler config-reference`` prints now, and
the README stays a newcomer's ten minutes. The packages' docstrings and comments are held to the
same: the paths they name exist and their ``:mod:``/``:class:``/... references resolve. The flags
and environment variables the pages name: tests/test_docs_commands.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Optional

import pytest

from tests.helpers.doc_names import NAMED_ROOTS, PACKAGES, SOURCE_DIRS, name_problem, resolve
from tests.helpers.paths import REPO
from transpiler.cli import config_reference, field_docs
from transpiler.config import DistributeTranspilerConfig
from transpiler.lifecycle import TableLifecycle

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The benchmarks' pages: their links and the paths they name are checked as the docs' are. The dated
# history files keep what they recorded (paths since moved among it), so only their links are checked.
RESULTS = REPO / "benchmarks" / "results"
BENCHMARK_PAGES = [
    REPO / "benchmarks" / "README.md",
    RESULTS / "RESULTS.md",
    RESULTS / "history" / "README.md",
]
HISTORY_PAGES = sorted((RESULTS / "history").glob("2*.md"))
README_MAX_LINES = 350

# Top-level folders whose paths a page may name: `pserver/engine/modes/sync.py`, deploy/slurm/train.sbatch.
PATH_ROOTS = (
    "trainer",
    "pserver",
    "proto",
    "transpiler",
    "tests",
    "benchmarks",
    "harness",
    "examples",
    "deploy",
    "docs",
)
# A path: a root, then nothing (the folder) or at least two characters ("examples/s" is a unit).
PATH = re.compile(r"(?<![\w/.-])(?:" + "|".join(PATH_ROOTS) + r")/(?:[\w./-]*[\w/]{2}|(?!\w))")
GENERATED = ("ps_pb2.py", "ps_pb2_grpc.py")  # protoc's output
# A docstring's reference: :mod:`.lanes`, :class:`~trainer.steppers.geo.GeoStepper`, :meth:`Stepper.push`.
ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):`~?([\w.]+)`")
FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
DOTTED = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
# `transpiler.py`, `job_metrics.py`: file names, checked as paths, not as names
FILE_SUFFIXES = {"py", "md", "proto", "json", "yaml", "png", "npy", "pt", "sbatch", "sh", "txt"}


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def code_spans(text: str):
    """(line number, content) of every inline code span outside fenced blocks."""
    for number, line in prose_lines(text):
        for match in CODE_SPAN.finditer(line):
            yield number, match.group(2).strip()


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> frozenset:
    """Every heading anchor of ``page``, repeated headings numbered as GitHub numbers them."""
    seen, found = {}, set()
    for _, line in prose_lines(page.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def repo_file(relative: str) -> Optional[Path]:
    """The repository path ``relative`` names, if it exists."""
    path = REPO / relative
    return path if path.exists() else None


def relative_links(page: Path):
    for number, line in prose_lines(page.read_text()):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            target = match.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
                yield number, target


@pytest.mark.parametrize(
    "page", PAGES + BENCHMARK_PAGES + HISTORY_PAGES, ids=lambda p: str(p.relative_to(REPO))
)
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    broken = []
    for number, target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        target_file = page if not path_part else (page.parent / path_part).resolve()
        relative = target_file.relative_to(REPO).as_posix() if target_file.is_relative_to(REPO) else None
        found = target_file if target_file.exists() else (repo_file(relative) if relative else None)
        if found is None:
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and found.suffix == ".md" and anchor not in anchors(found):
            broken.append(f"line {number}: {target} (no heading #{anchor} in {found.name})")
    assert broken == [], f"{page.name} links to what is not there:\n" + "\n".join(broken)


def test_the_benchmark_pages_are_checked():
    assert len(HISTORY_PAGES) >= 15 and all(p.is_file() for p in BENCHMARK_PAGES)


def path_pattern(roots) -> re.Pattern:
    """As ``PATH``, from other folders than the repository's top ones."""
    return re.compile(PATH.pattern.replace("|".join(PATH_ROOTS), "|".join(map(re.escape, roots))))


def named_paths(page: Path):
    """(line, path from the repository root) of every path ``page`` names, in prose and code alike.

    From the repository's top folders (`pserver/engine/modes/sync.py`), or, on a page below the top, from
    the page's own subfolders (benchmarks/README.md's `common/netns.py` is benchmarks/common/netns.py).
    """
    folder = page.parent.relative_to(REPO)
    own = sorted(d.name for d in page.parent.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))
    local = path_pattern(own) if folder.parts and own else None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for match in PATH.finditer(line):
            yield number, match.group(0)
        for match in local.finditer(line) if local else ():
            yield number, (folder / match.group(0)).as_posix()


@functools.cache
def benchmark_sources() -> str:
    return "".join(p.read_text() for p in (REPO / "benchmarks").rglob("*.py"))


def written_by_a_benchmark(relative: str) -> bool:
    """A results file a benchmark writes by default (`results/bench_hosts.json`), not one committed."""
    path = Path(relative)
    return path.parent == Path("benchmarks/results") and f'"{path.name}"' in benchmark_sources()


@pytest.mark.parametrize("page", PAGES + BENCHMARK_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_a_page_names_exists(page):
    """Paths in prose and in code blocks alike: `pserver/engine/modes/sync.py`, examples/train_mlp.py."""
    missing = [
        f"line {number}: {path}"
        for number, path in named_paths(page)
        if repo_file(path) is None and not written_by_a_benchmark(path)
    ]
    assert missing == [], f"{page.name} names paths that do not exist:\n" + "\n".join(missing)


def package_sources():
    """(module name, path) of each module of trainer, pserver, psproto and transpiler (not protoc's)."""
    for package, folder in SOURCE_DIRS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name not in GENERATED:
                module = ".".join((package, *path.relative_to(REPO / folder).with_suffix("").parts))
                yield module.removesuffix(".__init__"), path


@pytest.mark.parametrize("package", PACKAGES)
def test_every_repository_path_the_code_names_exists(package):
    """Docstrings and comments name files too (`see transpiler/roles/role_env.py`); they move with them."""
    missing = [
        f"{path.relative_to(REPO)}:{number}: {match.group(0)}"
        for module, path in package_sources()
        if module.split(".")[0] == package
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in PATH.finditer(line)
        if repo_file(match.group(0)) is None
    ]
    assert missing == [], "the code names paths that do not exist:\n" + "\n".join(missing)


def role_target(module: str, is_package: bool, target: str) -> Optional[str]:
    """The dotted name a docstring's ``:role:`target``` means, if it is ours (relative ones included)."""
    if target.startswith("."):
        # As a relative import: one dot is the module's package, each further dot one package up.
        dots = len(target) - len(target.lstrip("."))
        base = (module if is_package else module.rpartition(".")[0]).split(".")
        base = base[: len(base) - (dots - 1)]
        return ".".join(base) + "." + target[dots:]
    return target if target.split(".")[0] in PACKAGES else None


@pytest.mark.parametrize("package", PACKAGES)
def test_every_reference_a_docstring_makes_resolves(package):
    """``:mod:`.lanes``` (relative to the module), ``:class:`~trainer.steppers.geo.GeoStepper```: each names
    something the code has; short names (``:class:`TableSet```) are not followed."""
    wrong = []
    for module, path in package_sources():
        if module.split(".")[0] != package:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in ROLE.finditer(line):
                dotted = role_target(module, path.name == "__init__.py", match.group(1))
                problem = dotted and resolve(dotted)
                if problem:
                    wrong.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)}: {problem}")
    assert wrong == [], "docstrings refer to what the code does not have:\n" + "\n".join(wrong)


def named_in(page: Path):
    """(line, dotted name) for every dotted name in the page's inline code and its code blocks' imports."""
    text = page.read_text()
    for number, span in code_spans(text):
        for match in DOTTED.finditer(span):
            if match.group(1).rsplit(".", 1)[1] not in FILE_SUFFIXES:
                yield number, match.group(1)
    for number, line in enumerate(text.splitlines(), 1):
        match = re.match(r"\s*from\s+([\w.]+)\s+import\s+([\w, ]+)", line)
        if match and match.group(1).split(".")[0] in NAMED_ROOTS:
            for name in match.group(2).split(","):
                yield number, f"{match.group(1)}.{name.strip()}"
        match = re.match(r"\s*import\s+([\w.]+)\s*$", line)
        if match and match.group(1).split(".")[0] in NAMED_ROOTS:
            yield number, match.group(1)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_name_a_page_writes_exists(page):
    wrong = []
    for number, dotted in named_in(page):
        problem = name_problem(dotted)
        if problem:
            wrong.append(f"line {number}: `{dotted}`: {problem}")
    assert wrong == [], f"{page.name} names what the code does not have:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "dotted, ok",
    [
        ("trainer.PserverError", True),
        ("Trainer.step", True),
        ("RoleEnv.from_env", True),
        ("DistributeTranspilerConfig.checkpoint_dir", True),
        ("transpiler.tables.initial_rows", True),
        ("TableSet.apply_mean", False),  # the README's walk named it after it was gone
        ("Trainer.no_such_method", False),
        ("transpiler.no_such_module", False),
        ("NoSuchClass.method", False),
        ("tr.step", True),  # tr: a trainer of the examples
        ("tr.model", True),  # set in __init__
        ("tr.no_such_method", False),
        ("env.rank", True),
        ("model.load_state_dict", True),  # not ours: not checked
        ("harness.netns.Hosts", True),
        ("harness.netns.NoSuchHosts", False),
    ],
)
def test_the_names_check_itself(dotted, ok):
    assert (name_problem(dotted) is None) == ok


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("Collective mode (nccl2): DDP, no pservers", "collective-mode-nccl2-ddp-no-pservers"),
        ("Launching a job: `ps-launch`", "launching-a-job-ps-launch"),
        ("Environment variables (one script, every role)", "environment-variables-one-script-every-role"),
        ("A sync step, file by file", "a-sync-step-file-by-file"),
        ("max_rows and ram_rows", "max_rows-and-ram_rows"),
    ],
)
def test_github_slugs(heading, slug):
    assert github_slug(heading) == slug


def test_configuration_reference_is_current():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == config_reference(), (
        "docs/configuration.md is stale: run `python -m transpiler config-reference > docs/configuration.md`"
    )


def test_the_command_prints_the_reference(capsys):
    from transpiler.__main__ import main

    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == config_reference()


@pytest.mark.parametrize("cls", [DistributeTranspilerConfig, TableLifecycle], ids=lambda c: c.__name__)
def test_every_config_field_is_documented(cls):
    docs = field_docs(cls)  # raises, naming them, for fields without a description
    assert list(docs) == [f.name for f in dataclasses.fields(cls)]
    assert all(docs.values())


def test_an_undocumented_field_is_an_error():
    @dataclasses.dataclass
    class Settings:
        """Fields:

        - ``a``: documented.
        - ``gone``: a field that no longer exists.
        """

        a: int = 1
        b: int = 2

    with pytest.raises(ValueError, match=r"undocumented \['b'\], not fields \['gone'\]"):
        field_docs(Settings)


def test_the_environment_variables_the_reference_lists_are_read_by_the_code():
    listed = set(re.findall(r"^\| `(PS_[A-Z_]+)` \|", config_reference(), re.MULTILINE))
    assert listed, "the reference lists no environment variables"
    source = "".join(
        p.read_text() for d in SOURCE_DIRS.values() for p in (REPO / d).rglob("*.py") if p.name != "config.py"
    )
    assert sorted(v for v in listed if f'"{v}"' not in source) == []


def test_readme_is_a_newcomers_ten_minutes():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"
