"""python -m experiments.report --check: do the committed docs still say what their commands give?

For every marked block whose figures come from code alone (the settings tables, the memory table,
the busiest rank's traffic) or from a command that takes under two minutes on the development
machine (QUICK: the ablation and its variants), the check reruns the command into a temporary
folder (the command as the block's provenance line names it, run from that folder, so its
`--out results/...` lands there), renders every doc into a temporary copy from those results, and
compares each such block with the committed one, its provenance line aside. A block whose
figures differ is named with the first line that differs; nothing in the project is written.
Blocks from longer runs (the sweep, the benchmarks, the emulated cluster: timings or tens of
minutes) are listed as not checked, with their command.

Before any rerun it holds the prose to its rule (check_prose): outside the blocks and code fences,
README.md and docs/*.md hold at most MAX_PROSE_FIGURES figures with a unit and no commit hash (a
line that names a source or the paper may), no page runs over MAX_PAGE_LINES lines and the README
over MAX_README_LINES. A figure worth keeping goes into a block, with the command behind it;
history goes to CHANGELOG.md.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from experiments.report.tables import NAMED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = ("experiments.ablation",)  # modules whose runs take about two minutes here at most (the ablation with its whole run)
PROVENANCE = re.compile(r"^<sub>Rendered by .*</sub>$", re.M)
COMMAND = re.compile(r"`((?:python|torchrun) [^`]+)`")  # a provenance line's commands, each in backticks


def doc_paths(docs: str) -> list[str]:
    """The docs the report renders: every .md file of `docs`, sorted, and the README beside the folder where there is one."""
    readme = readme_path(docs)
    return sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md")) + ([readme] if os.path.exists(readme) else [])


def readme_path(docs: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(docs)), "README.md")


def command_env() -> dict:
    """The environment a block's command runs in: this one, with the project importable from any folder."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def _blocks(text: str, block: re.Pattern):
    """(name, args, body without its provenance line, the provenance line) of every marked block
    (`block`: the report's marker grammar)."""
    for m in block.finditer(text):
        body = m.group("body")
        prov = PROVENANCE.search(body)
        yield m.group("name"), m.group("args").split(), PROVENANCE.sub("", body).strip(), prov.group(0) if prov else ""


def _commands(prov: str) -> list[str]:
    """The commands a provenance line names, the report's own left out."""
    return [c for c in COMMAND.findall(prov) if not c.startswith("python -m experiments.report")]


def _quick(cmd: str) -> bool:
    parts = shlex.split(cmd)
    return len(parts) > 2 and parts[:2] == ["python", "-m"] and parts[2] in QUICK


def _checkable(name: str, args: list[str], prov: str) -> bool:
    if name == "figure":  # an image: its bytes are matplotlib's, not compared
        return False
    if name in NAMED or not args:  # rendered from code alone (the config tree, the presets)
        return True
    cmds = _commands(prov)
    return bool(cmds) and all(_quick(c) for c in cmds)


# the prose rule (docs/README of the docs): outside the rendered blocks and code fences, figures with a
# unit and commit hashes belong in a block (with the command behind them) or in CHANGELOG.md; a line
# that names a source (a paper's figure, a datasheet's) may hold them
MAX_PROSE_FIGURES = 60
MAX_PAGE_LINES = 350
MAX_README_LINES = 150
FIGURE = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?\s?(?:%|pp|ms|us|s|x|GB/s|GB|MB|KB|GiB|MiB|KiB|Gbit|Mbit|TFLOP)(?![\w/])")
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}\b")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def prose_lines(text: str, block: re.Pattern) -> list[tuple[int, str]]:
    """(line number, text) of every line outside the marked blocks and the code fences that names
    no source (no "source" or "paper" in it)."""
    blank = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731 (keeps the line numbers)
    kept = FENCE.sub(blank, block.sub(blank, text))
    return [(i, line) for i, line in enumerate(kept.splitlines(), 1) if "source" not in line.lower() and "paper" not in line.lower()]


def check_prose(docs: str, block: re.Pattern) -> list[str]:
    """The prose rule and the pages' lengths over README.md and docs/*.md: at most MAX_PROSE_FIGURES
    figures with a unit in all, no commit hash, no page over MAX_PAGE_LINES lines (the README over
    MAX_README_LINES). Each problem names the file and, for a hash, its line."""
    problems, figures = [], []
    for path in doc_paths(docs):
        text = open(path, encoding="utf-8").read()
        name = os.path.basename(path)
        limit = MAX_README_LINES if path == readme_path(docs) else MAX_PAGE_LINES
        if len(text.splitlines()) > limit:
            problems.append(f"{name} has {len(text.splitlines())} lines, over {limit}: split it by topic")
        for i, line in prose_lines(text, block):
            figures += [f"{name}:{i} {f!r}" for f in FIGURE.findall(line)]
            problems += [f"{name}:{i}: commit {h} outside a block's provenance (history goes to CHANGELOG.md)" for h in HASH.findall(line)]
    if len(figures) > MAX_PROSE_FIGURES:
        problems.append(
            f"{len(figures)} figures with a unit outside the rendered blocks, over {MAX_PROSE_FIGURES} (put them in a block with "
            f"their command, or name their source): {', '.join(figures[:8])}, ..."
        )
    return problems


def check(docs: str, render_doc, block: re.Pattern, timeout: float = 900.0, out=sys.stdout) -> list[str]:
    """The blocks whose committed figures differ from a fresh run's (empty: the docs hold).
    render_doc(path, results, docs) and `block` are the report's (experiments.report.__main__)."""
    prose = check_prose(docs, block)
    if prose:
        return prose
    readme = readme_path(docs)
    committed = {p: list(_blocks(open(p, encoding="utf-8").read(), block)) for p in doc_paths(docs)}
    todo, skipped = [], []
    for p, blocks in committed.items():
        for name, args, _, prov in blocks:
            if _checkable(name, args, prov):
                todo += [c for c in _commands(prov) if c not in todo]
            else:
                skipped.append(f"{os.path.basename(p)}: {name} {' '.join(args)} ({', '.join(_commands(prov)) or 'its command'})")
    problems = []
    with tempfile.TemporaryDirectory(prefix="report-check-") as tmp:
        env = command_env()
        # the commands run in a folder of their own (their results land there) that shows the project's
        # files where they are from its root: a command names a shipped file by its path (--model hf:config/...)
        root = os.path.dirname(os.path.abspath(docs))
        for name in os.listdir(root):
            if name not in ("docs", "results", "README.md") and not name.startswith("."):
                os.symlink(os.path.join(root, name), os.path.join(tmp, name))
        for cmd in todo:
            print(f"rerunning: {cmd}", file=out, flush=True)
            argv = [sys.executable, *shlex.split(cmd)[1:]]
            p = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
            if p.returncode != 0:
                problems.append(f"`{cmd}` failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
        if problems:
            return problems
        copy = os.path.join(tmp, "docs")
        shutil.copytree(docs, copy)
        if os.path.exists(readme):
            shutil.copy(readme, os.path.join(tmp, "README.md"))
        for p, blocks in committed.items():
            fresh_path = os.path.join(tmp, "README.md") if p == readme else os.path.join(copy, os.path.basename(p))
            fresh, _ = render_doc(fresh_path, os.path.join(tmp, "results"), copy)
            rendered = list(_blocks(fresh, block))
            for (name, args, body, prov), (_, _, new, _) in zip(blocks, rendered):
                if not _checkable(name, args, prov) or body == new:
                    continue
                pairs = zip(body.splitlines(), new.splitlines())
                first = next((f"committed {a!r}, rerun {b!r}" for a, b in pairs if a != b), "a line more or less")
                problems.append(f"{os.path.basename(p)}: block {name} {' '.join(args)} differs from a fresh run: {first}")
    print(f"checked {len(todo)} command(s) and the blocks rendered from code; not checked (longer runs, timings or images):", file=out)
    for s in skipped:
        print(f"  {s}", file=out)
    return problems
