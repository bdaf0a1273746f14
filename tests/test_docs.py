"""The docs name only what exists. In README.md and docs/*.md, every code span and code block is
read for:

- repository paths (`selfspec/decoding/modes/isd.py`, `bench/results/...`, also written relative
  to selfspec/ such as `decoding/step.py`, or to docs/ such as `results.md`; `<name>` is a
  wildcard), `module.name` references into selfspec's source (`training.config.LoopConfig`,
  `ngram.SuffixIndex`) and `file.py: name` citations; the layout tree of docs/architecture.md
  entry by entry; `sglang/...` paths in the installed SGLang;
- commands: `selfspec SUBCOMMAND [SUB-SUBCOMMAND] --flags` against the CLI's own parser (the
  subcommand exists, every flag is accepted, a value of a flag with choices is one of them),
  `python -m selfspec.X` (the module exists), `make TARGET` (a target of the Makefile),
  `python bench/X.py --flags` and `bash bench/X.sh --flags` (the script exists and defines the
  flags);
- the SGLang plugin's `--selfspec-*` flags, anywhere in the text, against `add_selfspec_args`;
- test ids: `tests/test_x.py::test_name`, bare `test_*` / `check_*` names of the test helpers,
  and the tensor / data parallel case ids (`tp-isd`) of tests/test_sglang_parallel.py.

Placeholders (CKPT, DIR, M, ORG/NAME, runs/..., /path/to/...), URLs, Hub names and the outputs of
a command (`--out X`) are not paths; the few other names that look like paths are in ALLOWED
with the reason. No server starts and no model loads: a few seconds, mostly building the CLI
parser."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "selfspec"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: path-like words that are not repository paths, each with its reason
ALLOWED = {
    "idlm_blockN4_config.yaml": "I-DLM's own algorithm config file, a file of the I-DLM release",
    "plan-isd.yaml": "the plan that the `selfspec tune --out plan-isd.yaml` example writes",
    "selfspec.bench.offline/v1": "the schema name of `bench offline --json` output",
    "selfspec.resolved": "a key of /server_info, not a module",
    "selfspec/decoding/modes/mymode.py": "the file a new decoding mode adds (docs/architecture.md's example)",
}
#: first components of Hub names (`yifanyu/I-DLM-8B`): models on the Hugging Face Hub, not paths
HUB_ORGS = {"yifanyu", "Qwen", "JacobiForcing"}
#: first components of paths that commands write (work files, build output), never committed
OUTPUT_ROOTS = {"runs", "dist"}
#: flags whose value is a file the command writes
OUTPUT_FLAGS = {"--out", "--json", "--plot", "--save-runs"}
#: extensions of a bare file name (no slash) that is checked; bare .json / .png / .bin names are
#: the files of a checkpoint or of a command's output
BARE_EXTENSIONS = (".py", ".md", ".sh", ".yaml", ".yml")
PATHLIKE = re.compile(r"[\w.*<>+-]+(?:/[\w.*<>+-]*)*")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
#: a dotted word ending in one of these is a file name (`selfspec.json`), not a module reference
FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "py", "md", "txt", "bin", "png", "safetensors", "whl", "sh"}
SHELL_END = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}
FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Snippet:
    doc: Path
    line: int
    text: str
    kind: str  # "span" (inline code), "shell" (a logical line of a code block) or "tree"

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


@cache
def snippets() -> tuple[Snippet, ...]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        masked = text
        for m in FENCE.finditer(text):
            lang, body = m.group(1), m.group(2)
            first = text.count("\n", 0, m.start(2)) + 1
            masked = masked[:m.start()] + re.sub(r"[^\n]", " ", m.group(0)) + masked[m.end():]
            if lang == "python":
                continue
            if lang == "" and re.match(r"[\w-]+/\s*\n", body):
                out.append(Snippet(doc, first, body, "tree"))
                continue
            logical, start = "", first
            for i, line in enumerate(body.splitlines()):
                if not logical:
                    start = first + i
                if line.rstrip().endswith("\\"):
                    logical += line.rstrip()[:-1] + " "
                    continue
                logical += line
                if logical.strip():
                    out.append(Snippet(doc, start, logical, "shell"))
                logical = ""
        for m in SPAN.finditer(masked):
            out.append(Snippet(doc, masked.count("\n", 0, m.start()) + 1, m.group(1), "span"))
    return tuple(out)


def words(snippet: Snippet) -> list[str]:
    text = " ".join(snippet.text.split())
    try:
        return shlex.split(text, comments=snippet.kind == "shell")
    except ValueError:  # an unbalanced quote in prose
        return text.split()


# ---------------------------------------------------------------------------------------- paths
@cache
def sglang_root() -> Path:
    """Where the installed SGLang lives (found without importing it): `sglang/...` paths and
    `sglang.x.y` names in the docs are SGLang's own files."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.fail("SGLang is not installed (the docs cite its files): run `make setup`")
    return Path(next(iter(spec.submodule_search_locations))).parent


def exists(path: str, roots: list[Path]) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", path.rstrip("/"))
    for root in roots:
        hits = list(root.glob(pattern)) if "*" in pattern else [root / pattern] if (root / pattern).exists() else []
        if any(h.is_dir() for h in hits) if path.endswith("/") else hits:
            return True
    return False


def roots_for(path: str) -> list[Path]:
    return [sglang_root()] if path.startswith("sglang/") else [REPO, PKG, REPO / "docs"]


def path_candidate(word: str) -> str | None:
    """The repository path a word names, or None for anything else."""
    word = word.strip("()[]{},;'\"").rstrip(":")
    if "=" in word:
        word = word.rsplit("=", 1)[1]
    if (not word or "://" in word or word.startswith(("/", "~", "-", "$", ".venv")) or "..." in word
            or "…" in word or not PATHLIKE.fullmatch(word) or word in ALLOWED):
        return None
    if "/" in word:
        parts = [re.sub(r"<[^>]*>", "x", p) for p in word.rstrip("/").split("/")]
        if parts[0] in OUTPUT_ROOTS or parts[0] in HUB_ORGS or any(PLACEHOLDER.fullmatch(p) for p in parts):
            return None
        return word
    if word.endswith(BARE_EXTENSIONS) and not PLACEHOLDER.fullmatch(word.rsplit(".", 1)[0]):
        return word
    return None


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Top-level names of a Python file, and the functions and classes at any depth."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return frozenset(names)


def module_file(dotted: list[str], root: Path) -> tuple[Path | None, list[str]]:
    """The longest prefix of `dotted` that is a module under root, and the names after it."""
    for n in range(len(dotted), 0, -1):
        base = root.joinpath(*dotted[:n])
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f, dotted[n:]
    return None, dotted


def check_reference(dotted: str) -> str | None:
    """`module.name` into selfspec's (or SGLang's) source: None when it resolves or is not one."""
    parts = dotted.split(".")
    if parts[0] == "selfspec":
        files = [module_file(parts[1:], PKG)]
    elif parts[0] == "sglang":
        files = [module_file(parts[1:], sglang_root() / "sglang")]
    elif (PKG / parts[0] / "__init__.py").is_file():
        files = [module_file(parts, PKG)]
    else:  # a module named by its file name alone: `ngram.SuffixIndex`, `corpus.SharedCorpus`
        files = [(f, parts[1:]) for f in sorted(PKG.rglob(f"{parts[0]}.py"))]
        if not files:
            return None
    if not any(f is not None and (not rest or rest[0] in defined_names(f)) for f, rest in files):
        return "no such module or name in selfspec's source" if parts[0] != "sglang" else "not in SGLang"
    return None


def tree_problems(snippet: Snippet) -> list[str]:
    """docs/architecture.md's layout tree: every folder entry exists under its parent, every
    backticked file name (and every plain `name.py`) in an entry's description under the entry."""
    problems = []
    stack: list[tuple[int, Path]] = []
    current = REPO
    entry = re.compile(r"( *)((?:[\w.-]+/)+(?:, (?:[\w.-]+/)+)*|\(top level\))(?=\s|$)")
    for i, line in enumerate(snippet.text.splitlines()):
        m = entry.match(line)
        indent = len(m.group(1)) if m else None
        if m and indent <= (stack[-1][0] + 2 if stack else 0):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else REPO
            names = [] if m.group(2) == "(top level)" else m.group(2).split(", ")
            for name in names:
                if not (parent / name).is_dir():
                    problems.append(f"{snippet.doc.relative_to(REPO)}:{snippet.line + i}: `{name}`: "
                                    f"no folder {(parent / name).relative_to(REPO)}/")
            current = parent / names[0] if names else parent
            stack.append((indent, current))
            line = line[m.end():]
        cited = SPAN.findall(line) + re.findall(r"(?<![\w/.`])\w+\.py\b(?!`)", line)
        for word in cited:
            if path_candidate(word) and not (current / word).exists():
                problems.append(f"{snippet.doc.relative_to(REPO)}:{snippet.line + i}: `{word}`: "
                                f"no {(current / word).relative_to(REPO)}")
    return problems


def test_every_path_named_in_the_docs_exists():
    problems = []
    for s in snippets():
        if s.kind == "tree":
            problems += tree_problems(s)
            continue
        ws = words(s)
        span = s.text.strip()
        # `file.py: name` / `file.py::name`: the name is defined in the file
        cite = re.fullmatch(r"(\S+\.py):{1,2} ?([\w:]+)(\[[^\]]*\])?", span)
        if cite and exists(cite.group(1), roots_for(cite.group(1))):
            f = next(r / cite.group(1) for r in roots_for(cite.group(1)) if (r / cite.group(1)).is_file())
            for name in cite.group(2).split("::"):
                if name not in defined_names(f):
                    problems.append(f"{s.where()}: `{span}`: no `{name}` in {cite.group(1)}")
        for i, word in enumerate(ws):
            if i and ws[i - 1] in OUTPUT_FLAGS and not word.startswith("bench/results/"):
                continue
            path = path_candidate(word.split("::")[0])
            if path is None:
                bare = word.strip("()[]{},;:'\"")
                reference = (DOTTED.fullmatch(bare) and bare.rsplit(".", 1)[1] not in FILE_SUFFIXES
                             and bare not in ALLOWED)
                if reference and (problem := check_reference(bare)):
                    problems.append(f"{s.where()}: `{bare}`: {problem}")
                continue
            if exists(path, roots_for(path)):
                continue
            # `path/module.name`: a name defined in path/module.py
            m = re.fullmatch(r"(.+)\.(\w+)", path)
            files = [r / f"{m.group(1)}.py" for r in roots_for(path)] if m else []
            if any(f.is_file() and m.group(2) in defined_names(f) for f in files):
                continue
            problems.append(f"{s.where()}: `{path}`: no such file or folder (under the repository, selfspec/ "
                            "or docs/)")
    assert not problems, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(problems)))


# ------------------------------------------------------------------------------------- commands
@cache
def cli_parser() -> argparse.ArgumentParser:
    from selfspec.cli import build_parser

    return build_parser()


@cache
def plugin_parser() -> argparse.ArgumentParser:
    from selfspec.sglang_ext.cli_args import add_selfspec_args

    parser = argparse.ArgumentParser()
    add_selfspec_args(parser)
    return parser


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def flag_problems(parser: argparse.ArgumentParser, args: list[str], command: str) -> list[str]:
    """Every `--flag` in args is one of the parser's, and a value given to a flag with choices
    is one of them (`a|b` lists alternatives; an upper-case value is a placeholder)."""
    problems = []
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if not arg.lstrip("[").startswith("--"):
            continue
        name, eq, value = arg.strip("[]").partition("=")
        action = parser._option_string_actions.get(name)
        if action is None:
            problems.append(f"`{command}` has no flag `{name}`")
            continue
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
        value = value.strip("[]")
        if action.choices and value and not PLACEHOLDER.fullmatch(value) and "<" not in value:
            bad = [v for v in value.split("|") if v not in action.choices]
            if bad:
                problems.append(f"`{command} {name}` takes none of {bad} (choices: {', '.join(map(str, action.choices))})")
    return problems


def selfspec_problems(argv: list[str]) -> list[str]:
    parser, command = cli_parser(), "selfspec"
    rest = list(argv)
    while (choices := subparsers(parser)) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        if name not in choices:
            return [f"`{command} {name}`: no such command (there are: {', '.join(choices)})"]
        parser, command = choices[name], f"{command} {name}"
    return flag_problems(parser, rest, command)


@cache
def imported_files(script: Path) -> tuple[Path, ...]:
    """The script and the selfspec modules it imports (where a shared parser may add its flags)."""
    files = [script]
    if script.suffix == ".py":
        for node in ast.walk(ast.parse(script.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("selfspec."):
                    f, _ = module_file(name.split(".")[1:], PKG)
                    if f is not None:
                        files.append(f)
    return tuple(files)


def script_flag_problems(script: Path, args: list[str]) -> list[str]:
    """A script or module run with `--flag` defines it: its text, or the text of a selfspec module
    it imports, names the flag in quotes."""
    text = "\n".join(f.read_text() for f in imported_files(script))
    flags = [a.strip("[]").split("=")[0] for a in args if a.lstrip("[").startswith("--")]
    quoted = (lambda f: f'"{f}"' in text or f"'{f}'" in text) if script.suffix == ".py" else (lambda f: f in text)
    return [f"`{script.relative_to(REPO)}` defines no flag `{f}`" for f in flags if not quoted(f)]


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", (REPO / "Makefile").read_text(), re.M))


def command_problems(s: Snippet) -> list[str]:
    ws = words(s)
    ends = [i for i, w in enumerate(ws) if w in SHELL_END]
    problems = []

    def until_end(i: int) -> list[str]:
        return ws[i:next((e for e in ends if e >= i), len(ws))]

    top = subparsers(cli_parser())
    if s.kind == "span" and ws and ws[0] in top:  # `bench serve --breakdown` stands for `selfspec bench ...`
        problems += selfspec_problems(until_end(0))
    for i, w in enumerate(ws):
        nxt = ws[i + 1] if i + 1 < len(ws) else None
        if w in ("selfspec", ".venv/bin/selfspec"):
            problems += selfspec_problems(until_end(i + 1))
        elif w == "-m" and nxt == "selfspec.cli":
            problems += selfspec_problems(until_end(i + 2))
        elif w == "-m" and nxt and nxt.startswith("selfspec."):
            try:
                spec = importlib.util.find_spec(nxt)
            except ModuleNotFoundError:
                spec = None
            if spec is None or spec.origin is None:
                problems.append(f"`python -m {nxt}`: no such module")
            else:
                problems += script_flag_problems(Path(spec.origin), until_end(i + 2))
        elif w == "make" and nxt and not nxt.startswith("-") and "=" not in nxt:
            if nxt not in makefile_targets():
                problems.append(f"`make {nxt}`: no such target in the Makefile")
        elif w in ("python", "bash") and nxt and nxt.endswith((".py", ".sh")) and not nxt.startswith("-"):
            script = REPO / nxt
            if not script.is_file():
                problems.append(f"`{w} {nxt}`: no such script")
            else:
                problems += script_flag_problems(script, until_end(i + 2))
    return problems


def test_every_command_and_flag_named_in_the_docs_exists():
    problems = [f"{s.where()}: {p}" for s in snippets() if s.kind != "tree" for p in command_problems(s)]
    assert not problems, "commands named in the docs that do not run as written:\n" + "\n".join(problems)


def test_every_selfspec_plugin_flag_named_in_the_docs_exists():
    known = plugin_parser()._option_string_actions
    problems = []
    for doc in DOCS:
        for m in re.finditer(r"--selfspec-[a-z][a-z-]*", doc.read_text()):
            if m.group(0) not in known:
                line = doc.read_text().count("\n", 0, m.start()) + 1
                problems.append(f"{doc.relative_to(REPO)}:{line}: `{m.group(0)}` is not a flag of the SGLang plugin")
    for s in snippets():
        ws = words(s)
        for i, w in enumerate(ws):
            if w.startswith("--selfspec-") and w.split("=")[0] in known:
                problems += [f"{s.where()}: {p}" for p in flag_problems(plugin_parser(), ws[i:i + 2], "sglang")]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------- test ids
@cache
def names_in_tests() -> frozenset[str]:
    names = set()
    for f in (REPO / "tests").glob("*.py"):
        names |= defined_names(f)
    return frozenset(names)


def parallel_case_ids() -> set[str]:
    """The case ids of tests/test_sglang_parallel.py (`tp-isd`), from its MODES / PARALLEL / CASES
    literals, evaluated without importing the module."""
    tree = ast.parse((REPO / "tests" / "test_sglang_parallel.py").read_text())
    wanted = {"MODES", "PARALLEL", "CASES"}
    body = [n for n in tree.body if isinstance(n, ast.Assign) and {getattr(t, "id", None) for t in n.targets} & wanted]
    namespace: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "test_sglang_parallel.py", "exec"), namespace)
    return {f"{p}-{m}" for p, m in namespace["CASES"]}


def test_every_test_id_named_in_the_docs_exists():
    problems = []
    cases = parallel_case_ids()
    for s in snippets():
        if s.kind == "tree":
            continue
        span = s.text.strip()
        if s.kind == "span" and re.fullmatch(r"(?:test|check)_\w+", span) and span not in names_in_tests():
            problems.append(f"{s.where()}: `{span}`: no such test or test helper under tests/")
        if s.kind == "span" and re.fullmatch(r"(?:tp|dp)-\w+", span) and span not in cases:
            problems.append(f"{s.where()}: `{span}`: not a case of tests/test_sglang_parallel.py "
                            f"(cases: {', '.join(sorted(cases))})")
        for w in words(s):
            m = re.fullmatch(r"(tests/[\w/]+\.py)((?:::\w+)+)(\[[^\]]*\])?", w.strip("(),;"))
            if m:
                f = REPO / m.group(1)
                missing = [n for n in m.group(2).split("::")[1:] if not f.is_file() or n not in defined_names(f)]
                if missing:
                    problems.append(f"{s.where()}: `{w}`: no {', '.join(missing)} in {m.group(1)}")
    assert not problems, "test ids named in the docs that do not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_code_spans_are_closed_within_a_paragraph(doc):
    """A stray backtick would pair the spans up wrongly (and hide names from the checks above)."""
    text = FENCE.sub("", doc.read_text())
    broken = [m.group(0)[:60] for m in SPAN.finditer(text) if "\n\n" in m.group(1) or "\n#" in m.group(1)]
    assert not broken, f"{doc.relative_to(REPO)}: unclosed code span near {broken}"
