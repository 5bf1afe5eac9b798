"""Plain-text tables of the benchmark reports."""

from __future__ import annotations


def print_table(rows: list[list[str]], hdr: list[str], left: int, last_left: bool = True) -> None:
    """Header, a -+- rule and the rows; the first `left` columns left-aligned,
    the others right-aligned, except the last one when last_left."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(hdr)]
    line = lambda cells: " | ".join(c.ljust(w) if i < left or (last_left and i == len(cells) - 1)
                                    else c.rjust(w)
                                    for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(hdr))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def pass_miss(ok: bool) -> str:
    return "PASS" if ok else "MISS"
