"""report --check's prose rule: outside the rendered blocks and code fences, README.md and docs/*.md
hold at most 60 figures with a unit and no commit hash (lines that name a source may), no page is
over 350 lines and the README over 150; held here on docs written for the case, counted by hand."""

import os

import pytest

from experiments.report.__main__ import BLOCK
from experiments.report.check import MAX_PROSE_FIGURES, check_prose

BLOCK_TEXT = (
    "<!-- report:ablation ablation -->\n| a | 12.5% | 3 ms | 9f8e7d6 |\n\n<sub>Rendered ... (commit 1a2b3c4)</sub>\n<!-- /report -->\n"
)


def _docs(tmp_path, pages: dict[str, str], readme: str = "# Readme\n") -> str:
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in pages.items():
        (docs / name).write_text(text)
    (tmp_path / "README.md").write_text(readme)
    return str(docs)


def test_the_committed_docs_keep_the_rule():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert check_prose(os.path.join(root, "docs"), BLOCK) == []


def test_figures_in_blocks_fences_and_sourced_lines_are_not_counted(tmp_path):
    fence = "```bash\n" + "echo 5 ms 6 ms 7%\n" * 100 + "```\n"
    sourced = "The datasheet's 989 TFLOP and 3.35 GB/s (its source: the vendor).\n" * 80
    paper = "The paper's -5.95% and +3.75 pp.\n" * 80
    docs = _docs(tmp_path, {"a.md": BLOCK_TEXT * 30 + fence, "b.md": sourced + paper})
    assert check_prose(docs, BLOCK) == []


def test_a_figure_past_the_limit_is_refused_and_named(tmp_path):
    lines = "".join(f"A step took {k} ms here.\n" for k in range(MAX_PROSE_FIGURES + 1))
    (tmp_path / "at").mkdir(), (tmp_path / "over").mkdir()
    docs = _docs(tmp_path / "at", {"a.md": lines[: lines.index(f"{MAX_PROSE_FIGURES} ms")]})
    assert check_prose(docs, BLOCK) == []  # exactly the limit
    problems = check_prose(_docs(tmp_path / "over", {"a.md": lines}), BLOCK)
    assert len(problems) == 1 and f"{MAX_PROSE_FIGURES + 1} figures with a unit" in problems[0] and "a.md:1 '0 ms'" in problems[0]


@pytest.mark.parametrize(
    "text, found", [("moved at commit 8e36419 and fd69a52.\n", 2), ("the default 4096 tokens, deadbeef and 1234567\n", 0)]
)
def test_a_commit_hash_outside_the_blocks_is_refused_with_its_line(tmp_path, text, found):
    problems = check_prose(_docs(tmp_path, {"a.md": "# A\n\n" + text}), BLOCK)
    assert len(problems) == found and all(p.startswith("a.md:3: commit ") for p in problems)


def test_a_long_page_and_a_long_readme_are_refused(tmp_path):
    docs = _docs(tmp_path, {"ok.md": "x\n" * 350, "long.md": "x\n" * 351}, readme="y\n" * 151)
    problems = check_prose(docs, BLOCK)
    assert sorted(p.split(" ")[0] for p in problems) == ["README.md", "long.md"]
    assert "351 lines, over 350" in " ".join(problems) and "151 lines, over 150" in " ".join(problems)
