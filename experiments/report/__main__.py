"""Render the docs' tables and figures from results/ (and from the config tree): one command.

    python -m experiments.report                  # every marked block of docs/*.md, every figure
    python -m experiments.report --strict         # fail if a block's results are missing
    python -m experiments.report --check          # write nothing: do the committed docs still hold? (CI runs it)
    python -m experiments.report --rerun          # rerun every block's command at this commit (hours), then render

A block in a doc is marked

    <!-- report:NAME ARG ... -->
    (what the report wrote last time)
    <!-- /report -->

where NAME is a renderer of experiments.report.tables (or `figure`) and each ARG a path inside
--results. The report replaces what lies between the markers with the rendered table and one
provenance line: the command that wrote the results, its commit, device and date. Prose around
the blocks is written by hand and never touched. A block whose results are missing keeps its old
content and is named, with the command that would write them.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

from config.cli import Command
from config.entries import ReportOptions
from experiments.common import entry
from experiments.common.errors import USER_ERRORS, InputError
from experiments.common.provenance import shown_commit
from experiments.report import figures
from experiments.report.check import check, doc_paths
from experiments.report.rerun import rerun
from experiments.report.tables import NAMED, RENDERERS

BLOCK = re.compile(r"(<!-- report:(?P<name>[a-z-]+)(?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- /report -->)", re.S)
MARKER = re.compile(r"<!-- (?:report:(?P<name>[^\s>]*)[^>]*?|(?P<close>/report)) -->")
# what writes the results a block reads, for the message when they are missing
WRITERS = {
    "ablation": "python -m experiments.ablation",
    "sweep": "python -m experiments.ablation.sweep",
    "solver_bench": "python -m experiments.bench.solver",
    "host_bench": "python -m experiments.bench.host",
    "kernel_static": "python -m experiments.bench.kernels",
    "gpu_check": "python3 -m experiments.gpu_check --out results/gpu_check (on a CUDA machine)",
    "groups_bench": "python -m experiments.bench.groups",
    "contention_bench": "python -m experiments.bench.contention",
    "emulated": "python -m experiments.calibrate.emulate --compare (as root)",
}


COMMAND = Command("experiments.report", __doc__, (ReportOptions,))


def provenance_line(prov: list[dict], commits: bool = True) -> str:
    """What a block was rendered from: each source's command, commit, device and date (commits=False:
    the README's short form, which points to docs/ for the rest)."""
    if not commits:
        made = ", ".join(f"`{p['command']}`" for p in prov if p.get("command"))
        return f"<sub>Rendered by `python -m experiments.report` from the results of {made}; with provenance in docs/.</sub>"
    parts = []
    for p in prov:
        when = (p.get("time_utc") or "")[:10]
        made = f"`{p['command']}`" if p.get("command") else "its command"
        commit = shown_commit(p)  # a run from a copy whose git was older than its files: the commit of its files
        at = ", ".join(x for x in (f"commit {commit}" if commit else "", p.get("device", ""), when) if x)
        parts.append(f"{p['where']}: {made}" + (f" ({at})" if at else ""))
    return "<sub>Rendered by `python -m experiments.report` from " + "; ".join(parts) + ".</sub>"


def render_block(name: str, args: list[str], results: str, docs: str, here: str, commits: bool = True, staging: str | None = None) -> str:
    """One block's markdown; `here` is the folder of the file it goes into (image links are relative
    to it). A figure is drawn into `staging` where given (the report moves it into docs/figures/
    once every doc has rendered), else straight into docs/figures/."""
    paths = args if name in NAMED else [os.path.join(results, a) for a in args]
    if name == "figure":
        final = os.path.join(docs, "figures")
        path, prov = figures.render(args[0], paths[1:], staging or final)
        link = os.path.relpath(os.path.join(final, os.path.basename(path)), here)
        return f"![{args[0]}]({link})\n\n{provenance_line(prov, commits)}\n"
    if name not in RENDERERS:
        raise InputError(f"no renderer {name!r}; renderers: {sorted(RENDERERS)} and figure")
    text, prov = RENDERERS[name](*paths)
    return f"{text}\n\n{provenance_line(prov, commits)}\n"


def check_markers(path: str, text: str) -> None:
    """Every opening marker is closed before the next one opens, every closing marker closes one,
    and every block names a renderer: otherwise InputError naming the doc's line, before anything
    is written (a block left open would take the prose up to the next block's closing marker)."""
    line = lambda at: text.count("\n", 0, at) + 1  # noqa: E731
    names = sorted(RENDERERS) + ["figure"]
    open_at = None
    for m in MARKER.finditer(text):
        if m.group("close"):
            if open_at is None:
                raise InputError(f"{path} line {line(m.start())}: a closing <!-- /report --> with no block open (a stray marker)")
            open_at = None
            continue
        if open_at is not None:
            raise InputError(
                f"{path} line {line(open_at)}: the block opened there has no closing <!-- /report --> before the next block "
                f"(line {line(m.start())}): add it"
            )
        if m.group("name") not in names:
            raise InputError(f"{path} line {line(m.start())}: report:{m.group('name')} names no renderer; renderers: {names}")
        open_at = m.start()
    if open_at is not None:
        raise InputError(f"{path} line {line(open_at)}: the block opened there has no closing <!-- /report -->: add it")


def render_doc(path: str, results: str, docs: str, staging: str | None = None) -> tuple[str, list[str]]:
    """The doc's text with every block rendered, and what could not be (missing results). The
    README's blocks carry no commit hashes (its provenance is the docs'). Figures go to `staging`
    where given (render_block)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path} cannot be read as UTF-8 text ({e})") from None
    check_markers(path, text)
    here = os.path.dirname(os.path.abspath(path))
    commits = os.path.basename(path) != "README.md"
    missing: list[str] = []

    def one(m: re.Match) -> str:
        name, args = m.group("name"), m.group("args").split()
        try:
            body = render_block(name, args, results, docs, here, commits, staging)
        except InputError as e:
            raise InputError(f"{path} line {text.count(chr(10), 0, m.start()) + 1}, block {name} {' '.join(args)}: {e}") from None
        except FileNotFoundError as e:
            first = os.path.relpath(str(e.args[0]), results).split(os.sep)[0]
            writer = WRITERS.get(first.removesuffix(".csv").removesuffix("_joint"), "its experiment")
            missing.append(f"{os.path.basename(path)}: {name} {' '.join(args)}: {e.args[0]} is missing ({writer})")
            return m.group(0)
        return m.group(1) + body + m.group(5)

    return BLOCK.sub(one, text), missing


def main(argv=None) -> int:
    opts = entry.parse(COMMAND, argv).report
    if not os.path.isdir(opts.docs):
        entry.fail(f"--docs {opts.docs!r} is not a folder of docs")
    if opts.check_docs:
        with entry.user_errors():
            problems = check(opts.docs, render_doc, BLOCK)
        for p in problems:
            print(f"  stale: {p}", file=sys.stderr)
        print(f"report --check: {len(problems)} block(s) differ from a fresh run" if problems else "report --check: the docs hold")
        return 1 if problems else 0
    if opts.rerun:
        with entry.user_errors():
            failed = rerun(opts.docs, opts.results, BLOCK)
        if failed:
            entry.fail(f"report --rerun: {failed[0]}; nothing rendered")
    docs = doc_paths(opts.docs)
    missing, rendered, texts = [], 0, {}
    with tempfile.TemporaryDirectory(prefix=".figures-", dir=opts.docs) as staging:
        try:
            for path in docs:  # every doc's markers checked before any block is rendered
                with open(path, encoding="utf-8") as f:
                    check_markers(path, f.read())
            for path in docs:  # every doc rendered, its figures into `staging`, before anything is written
                texts[path], gaps = render_doc(path, opts.results, opts.docs, staging)
                missing += gaps
                rendered += len(BLOCK.findall(texts[path])) - len(gaps)
        except (*USER_ERRORS, OSError, UnicodeDecodeError) as e:
            entry.fail(f"{e}; no doc and no figure was written")
        figures_dir = os.path.join(opts.docs, "figures")
        os.makedirs(figures_dir, exist_ok=True)
        for name in sorted(os.listdir(staging)):  # the same file system: each figure replaced whole
            os.replace(os.path.join(staging, name), os.path.join(figures_dir, name))
    for path, text in texts.items():
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        except OSError as e:
            entry.fail(f"{path!r} cannot be written: {e.strerror or e}")
    print(f"rendered {rendered} blocks in {len(docs)} docs from {opts.results}/")
    for m in missing:
        print(f"  not rendered, kept as it was: {m}", file=sys.stderr)
    return 1 if missing and opts.strict else 0


if __name__ == "__main__":
    sys.exit(main())
