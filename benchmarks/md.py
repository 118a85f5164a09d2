"""Markdown helpers the benchmark scripts share to write their tables (`md.table`)."""


def table(header: list[str], rows: list[list]) -> str:
  """A markdown table: a header row, the separator, one line per row."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def ratio(value: float) -> str:
  """A ratio as the page writes it: `1.027x`."""
  return f"{value:.3f}x"


def verdict(ok: bool) -> str:
  """A goal's verdict, computed from the numbers."""
  return "**met**" if ok else "**not met**"


def not_measured(what: str) -> str:
  """The line a table writes in place of results that were not saved."""
  return f"Not measured: no saved results for {what}."
