"""Helpers shared by the benchmark scripts: machine description and result sections."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "docs" / "bench"


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = "?"
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}; commit {rev}; {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )


def write_section(area: str, markdown: str) -> Path:
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    p = BENCH_DIR / f"{area}.md"
    p.write_text(markdown.rstrip() + "\n")
    return p


def md_table(header: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(x) for x in r) + " |")
    return "\n".join(out)
