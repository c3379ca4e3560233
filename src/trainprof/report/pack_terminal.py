"""The terminal view of ``trainprof pack`` (rich): what was packed, the read check, how to use it.

It renders the document ``commands.pack_command`` builds; it computes nothing.
"""

from __future__ import annotations

import sys
from typing import IO, Any

import numpy as np
from rich.table import Table
from rich.text import Text

from trainprof.report.console import make_console, print_command

_CODEC = {
    "image": "encoded image bytes, decoded when read",
    "npy": ".npy bytes, decoded when read",
    "raw": "bytes",
    "utf8": "text",
    "pickle": "pickled objects",
}


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _field(field: dict[str, Any], default: list[str]) -> str:
    if field["kind"] == "blob":
        what = _CODEC.get(field["codec"], field["codec"])
    elif field["kind"] == "array":
        shape = "×".join(str(s) for s in field["shape"])
        what = f"{np.dtype(field['dtype']).name}{f' ({shape})' if shape else ''}, one column"
    else:
        what = f"{np.dtype(field['dtype']).name} arrays of varying shape"
    hidden = "" if field["name"] in default else "; not returned by default"
    return f"{field['name']} ({what}{hidden})"


def render_pack(doc: dict[str, Any], file: IO[str] | None = None) -> None:
    console = make_console(file if file is not None else sys.stdout)
    manifest = doc["manifest"]
    source = manifest.get("source", {})
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    console.print(f"[bold]trainprof pack[/bold]  {doc['source']} → {doc['out']}")
    detail = []
    if manifest.get("classes") is not None:
        detail.append(f"{len(manifest['classes'])} classes")
    if source.get("skipped_top_level_files"):
        skipped = source["skipped_top_level_files"]
        detail.append(f"{skipped} top-level file{'s' if skipped != 1 else ''} skipped, as "
                      "ImageFolder does")
    if source.get("skipped_non_image_files"):
        skipped = source["skipped_non_image_files"]
        detail.append(f"{skipped} file{'s' if skipped != 1 else ''} that "
                      f"{'are' if skipped != 1 else 'is'} not an image skipped, as ImageFolder "
                      "does")
    shards = len(manifest["shards"])
    about = f" ({', '.join(detail)})" if detail else ""
    grid.add_row(
        "Packed",
        f"{manifest['count']:,} samples{about} · "
        f"{_size(source.get('bytes', 0))} of files → {_size(doc['pack_bytes'])} in "
        f"{shards} shard{'s' if shards != 1 else ''}"
        f"{' + columns' if doc['columns'] else ''} · {manifest['write_s']:.1f} s",
    )
    default = manifest["default_fields"]
    grid.add_row("Fields", " · ".join(_field(f, default) for f in manifest["fields"]))
    reads = doc.get("reads")
    if reads:
        what = "decoded samples" if reads["decoded"] else "samples"
        check = ("content identical" if reads["identical"]
                 else "[bold red]CONTENT DIFFERS from the files[/bold red]")
        grid.add_row(
            "Reads",
            f"{reads['samples']:,} random {what}, warm page cache, best of {reads['rounds']}: "
            f"files {reads['files_per_s']:,.0f}/s · pack {reads['pack_per_s']:,.0f}/s "
            f"([bold]×{reads['speedup']:.1f}[/bold]); {check}",
        )
    console.print(grid)
    # the code on a line of its own, whole: wrapped in the grid's cell, its first line pasted
    # alone was a syntax error
    console.print(Text("Use it", style="bold"))
    print_command(console, doc["usage"], indent=2)
