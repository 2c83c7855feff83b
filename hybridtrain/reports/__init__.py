"""The paper's outputs: its formulas (``paper_metrics``), a run's report (``report``), the named comparisons
(``experiments``), and ``markdown_table``, the writer of every table the commands print.

May import: engine and everything below it. Nothing imports it except cli, perf and predict.
"""
from __future__ import annotations


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table, the one writer of every table the commands print; each cell is ``str()``-ed and a '|'
    in it is escaped so the columns hold."""
    def line(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    return "\n".join([line(header), line(["---"] * len(header))] + [line(r) for r in rows])
