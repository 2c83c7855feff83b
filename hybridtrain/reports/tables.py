"""Markdown tables: one writer for every table the commands print."""
from __future__ import annotations


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; each cell is ``str()``-ed and a '|' in it is escaped so the columns hold."""
    def line(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    return "\n".join([line(header), line(["---"] * len(header))] + [line(r) for r in rows])
