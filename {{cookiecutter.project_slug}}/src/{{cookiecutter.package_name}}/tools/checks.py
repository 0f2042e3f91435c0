"""The verdicts and the table that the smoke check and `diagnose doctor` print."""

from __future__ import annotations

PASS, WARN, FAIL, SKIP, INFO = "PASS", "WARN", "FAIL", "SKIP", "INFO"

Row = tuple[str, str, str]  # (verdict, what was checked, detail)


def table(title: str, rows: list[Row]) -> str:
    """One aligned line per row, then `title: PASS|FAIL (N failed, M warnings)`."""
    width = max(len(name) for _, name, _ in rows)
    lines = [f"{verdict:<4}  {name:<{width}}  {detail}" for verdict, name, detail in rows]
    failed = sum(verdict == FAIL for verdict, _, _ in rows)
    warned = sum(verdict == WARN for verdict, _, _ in rows)
    lines.append(f"{title}: {FAIL if failed else PASS} ({failed} failed, {warned} warnings)")
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    return 1 if any(verdict == FAIL for verdict, _, _ in rows) else 0
