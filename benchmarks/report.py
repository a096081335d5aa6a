"""`streamer bench` output: one table per comparison, printed with rich and written as BENCHMARKS.md."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from memory_model import format_size


@dataclass(frozen=True)
class Section:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"{self.title}: row {row} has {len(row)} cells for {len(self.columns)} columns")

    def rich(self) -> Table:
        table = Table(title=self.title, title_justify="left")
        for i, name in enumerate(self.columns):
            table.add_column(name, justify="left" if i == 0 else "right", overflow="fold")
        for row in self.rows:
            table.add_row(*row)
        if self.notes:
            table.caption = "\n".join(self.notes)
            table.caption_justify = "left"
        return table

    def markdown(self) -> str:
        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", " ")
        lines = [f"## {self.title}", "", "| " + " | ".join(map(cell, self.columns)) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|"]
        lines += ["| " + " | ".join(map(cell, row)) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


def verdict(met: bool | None) -> str:
    return "unmeasured" if met is None else ("met" if met else "NOT met")


def seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3g} s" if value < 100 else f"{value:,.0f} s"


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def size(value: int | float | None) -> str:
    return "—" if value is None else format_size(int(value))


def params(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,}"


def count(value: float | None) -> str:
    """A count to 3 significant digits: 748k, 1.3M."""
    if value is None:
        return "—"
    if value >= 999_500:
        return f"{value / 1e6:.3g}M"
    return f"{value / 1e3:.3g}k" if value >= 999.5 else f"{value:.0f}"


def rate(bytes_per_s: float | None) -> str:
    return "—" if bytes_per_s is None else f"{bytes_per_s / 1e9:.2f} GB/s"


def percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def write_markdown(path: Path, machine: list[str], command: str, duration_s: float, summary: list[str],
                   sections: list[Section]) -> None:
    """BENCHMARKS.md: written whole by `streamer bench`, never by hand (every number is from this run)."""
    parts = ["# Benchmarks", "",
             "Written by `streamer bench`; every number below was measured in the run this file describes. "
             "Do not edit by hand: rerun the command.", "",
             "## Machine and command", ""]
    parts += [f"- {line}" for line in machine]
    parts += [f"- command: `{command}`", f"- wall time of the whole run: {duration_s / 60:.1f} min", ""]
    if summary:
        parts += ["## Targets", ""] + [f"- {line}" for line in summary] + [""]
    text = "\n".join(parts) + "\n" + "\n".join(section.markdown() for section in sections)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _target_name(line: str) -> str:
    """A target line's name: the text before its verdict (`name: met (value)`)."""
    match = re.match(r"- (.*?): (met|NOT met|unmeasured)\b", line)
    return match.group(1) if match else line


def update_markdown(path: Path, provenance: str, summary: list[str], sections: list[Section],
                    order: Sequence[str] = ()) -> None:
    """A partial run's sections written into a report of a full run, which keeps the rest: a section of the same
    title is replaced, a new one goes after the last section of its number, else after the last section that
    comes before it in `order` (a full run's titles, in its order), else at the end; its target lines replace
    those of the same name. `provenance` (the partial run's command, commit and date) is the sections' first note
    and a line of the report's machine list, since the rest of the file describes another run."""
    text = path.read_text()
    blocks = re.split(r"(?m)^(?=## )", text)  # blocks[0]: the title and intro; each other starts with its heading
    titles = [b.split("\n", 1)[0][3:] for b in blocks]
    for section in sections:
        new = Section(section.title, section.columns, section.rows, (provenance, *section.notes)).markdown() + "\n"
        if section.title in titles:
            blocks[titles.index(section.title)] = new
            continue
        number = section.title.split(" ", 1)[0]
        earlier = set(order[:list(order).index(section.title)]) if section.title in order else set()
        same = [i for i, t in enumerate(titles) if t.split(" ", 1)[0] == number] or \
            [i for i, t in enumerate(titles) if t in earlier]
        at = same[-1] + 1 if same else len(blocks)
        blocks.insert(at, new)
        titles.insert(at, section.title)
    if "Targets" in titles:
        i = titles.index("Targets")
        names = {_target_name(f"- {t}") for t in summary}
        kept = [line for line in blocks[i].splitlines()[1:]
                if line.startswith("- ") and _target_name(line) not in names]
        blocks[i] = "\n".join(["## Targets", "", *kept, *(f"- {t}" for t in summary)]) + "\n\n"
    if "Machine and command" in titles:
        i = titles.index("Machine and command")
        wrote = "wrote " + ", ".join(f"\"{s.title}\"" for s in sections)
        lines = [line for line in blocks[i].splitlines()[1:] if line.startswith("- ") and not line.endswith(wrote)]
        blocks[i] = "\n".join(["## Machine and command", "", *lines, f"- {provenance}; {wrote}"]) + "\n\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(blocks))
    tmp.replace(path)
