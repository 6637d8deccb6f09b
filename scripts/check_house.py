#!/usr/bin/env python
"""The house's size targets, measured and held: `make test` runs this and fails when a figure
exceeds its ceiling.

    .venv/bin/python scripts/check_house.py [--list]

Each target has a goal and a ceiling. Where the goal is met the ceiling is the goal; where it is
not yet met the ceiling is the figure reached so far, and may only come down (lower it when a
change improves the figure; this script says so). --list names every offender.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "diffuse"
MAX_FUNCTION_LINES = 50
RUN_FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|tok/s|tokens/s|tokens per second)\b|\b\d+\.\d+x\b")


@dataclass(frozen=True)
class Target:
    name: str
    goal: int
    ceiling: int  # the goal once met; until then the best figure so far


TARGETS = (
    Target("lines in diffuse/cli/", 800, 800),
    Target(f"functions in diffuse/ over {MAX_FUNCTION_LINES} lines", 0, 0),
    Target("modules outside diffuse/control/ importing libp2p", 0, 0),
    Target("lines of DESIGN.md", 600, 600),
    Target("comment or docstring lines in diffuse/ carrying run figures", 10, 10),
    Target("scripts importing another script or the tests (scripts/support is what they share)", 0, 0),
)


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def cli_lines() -> tuple[int, list[str]]:
    files = sorted((PACKAGE / "cli").glob("*.py"))
    return sum(map(lines, files)), [f"{p.relative_to(ROOT)}: {lines(p)}" for p in files]


def long_functions() -> tuple[int, list[str]]:
    found = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return len(found), found


def libp2p_importers() -> tuple[int, list[str]]:
    found = []
    for path in modules():
        if (PACKAGE / "control") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] in ("libp2p", "multiaddr") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return len(found), found


def design_lines() -> tuple[int, list[str]]:
    return lines(ROOT / "DESIGN.md"), []


def prose_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a module."""
    lines = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines += [(first.lineno + i, text) for i, text in enumerate(first.value.value.splitlines())]
    return lines


def run_figures() -> tuple[int, list[str]]:
    found = [f"{path.relative_to(ROOT)}:{n}: {text.strip()}" for path in modules()
             for n, text in prose_lines(path.read_text()) if RUN_FIGURE.search(text)]
    return len(found), found


def imported(path: Path) -> set[str]:
    """The top-level names a module imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").split(".")[0])
    return names


def script_imports() -> tuple[int, list[str]]:
    """A script is a tool: what scripts share lives in scripts/support, and support imports no script."""
    scripts = ROOT / "scripts"
    forbidden = {p.stem for p in scripts.glob("*.py")} | {p.stem for p in (ROOT / "tests").glob("*.py")}
    modules = sorted([*scripts.glob("*.py"), *scripts.glob("support/*.py")])
    found = [f"{path.relative_to(ROOT)}: {name}" for path in modules
             for name in sorted(imported(path) & forbidden)]
    return len(found), found


MEASURES = (cli_lines, long_functions, libp2p_importers, design_lines, run_figures, script_imports)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="name every offender")
    args = parser.parse_args()
    failed = False
    print("| target | goal | ceiling | now | |\n|---|---|---|---|---|")
    for target, measure in zip(TARGETS, MEASURES):
        now, found = measure()
        verdict = "over the ceiling" if now > target.ceiling else \
            "met" if now <= target.goal else "lower the ceiling" if now < target.ceiling else "not yet"
        failed |= now > target.ceiling
        print(f"| {target.name} | {target.goal} | {target.ceiling} | {now} | {verdict} |")
        if args.list and target.goal < now:
            print("\n".join(f"    {f}" for f in found))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
