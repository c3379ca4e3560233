"""The terminal report of ``trainprof trace`` (rich). It renders the analysis document only."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO, Any

from rich.table import Table
from rich.text import Text

from trainprof.report.console import keep_numbers_whole, make_console
from trainprof.report.terminal import _print_finding, fmt_bytes, fmt_flops

#: Breakdown categories, their labels (the TensorBoard plugin's) and colours.
_CATEGORY_STYLE = {
    "Kernel": ("Kernel", "green"),
    "Memcpy": ("Memcpy", "cyan"),
    "Memset": ("Memset", "bright_cyan"),
    "Communication": ("Communication", "magenta"),
    "Runtime": ("Runtime", "yellow"),
    "DataLoader": ("DataLoader", "red"),
    "CpuOp": ("CPU Exec", "blue"),
    "Other": ("Other", "white"),
}


def _us(us: float | None) -> str:
    if us is None:
        return "—"
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.1f} ms"
    return f"{us:.0f} µs" if us >= 10 else f"{us:.1f} µs"


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{round(x, digits) + 0.0:.{digits}f}%"  # no "-0%"


def _bar(pct: dict[str, float], width: int = 48) -> Text:
    bar = Text()
    for key, (_, style) in _CATEGORY_STYLE.items():
        n = round(pct.get(key, 0.0) / 100.0 * width)
        if n:
            bar.append("█" * n, style=style)
    return bar


def _steps_text(doc: dict[str, Any]) -> str:
    steps = doc.get("steps") or []
    st = doc.get("step_time_us") or {}
    window = doc.get("window") or {}
    if not doc.get("steps_found"):
        return f"none found: the whole trace is one window of {_us(window.get('duration_us'))}"
    ids = f"{steps[0]}–{steps[-1]}" if len(steps) > 6 else ", ".join(steps)
    where = "on the device timeline" if window.get("on_device_timeline") else "host ranges"
    text = (
        f"{len(steps)} analysed ({ids}), {where} · step time mean {_us(st.get('mean'))} "
        f"(min {_us(st.get('min'))}, max {_us(st.get('max'))})"
    )
    removed = window.get("removed_tail_steps") or []
    if removed:
        text += f" · left out: {', '.join(removed)}"
    return text


def _header(doc: dict[str, Any]) -> Text:
    fmt = doc.get("format") or {}
    line = Text("trainprof trace ", style="bold")
    line.append(os.path.basename(str(doc.get("source") or "")), style="bold")
    ranks = doc.get("ranks")
    facts = [str(fmt.get("device_type") or "?")]
    gpus = doc.get("gpu") or {}
    names = sorted({str(g.get("name")) for g in gpus.values() if g.get("name")})
    if names:
        facts.append(", ".join(names))
    if ranks:
        facts.append(f"{len(ranks)} {'ranks' if _one_job(doc) else 'separate traces'}")
    facts.append(f"{fmt.get('events', 0):,} events")
    if fmt.get("json_bytes"):
        facts.append(f"{fmt_bytes(fmt['json_bytes'])} JSON")
    line.append("  (" + " · ".join(facts) + ")")
    return line


def _breakdown_table(doc: dict[str, Any]) -> Table:
    bd = doc.get("breakdown_us") or {}
    pct = doc.get("breakdown_pct") or {}
    table = Table(box=None, padding=(0, 2), show_header=True, header_style="bold")
    table.add_column("category")
    table.add_column("avg per step", justify="right")
    table.add_column("share", justify="right")
    table.add_column("")
    cpu_only = doc.get("cpu_only")
    for key, (label, style) in _CATEGORY_STYLE.items():
        if key in ("Kernel", "Memcpy", "Memset", "Runtime", "Communication") and not bd.get(key) \
                and (cpu_only or key == "Communication"):
            continue
        share = pct.get(key, 0.0)
        table.add_row(
            Text(label, style=style), _us(bd.get(key)), _pct(share),
            Text("█" * round(share / 100 * 30), style=style),
        )
    table.add_row(Text("Total (step)", style="bold"), _us(bd.get("Total")), "100%", "")
    return keep_numbers_whole(table)


def _gpu_line(g: dict[str, Any]) -> str:
    parts = []
    if g.get("name"):
        parts.append(str(g["name"]))
    parts.append(f"utilization {_pct(g.get('utilization'))}")
    if g.get("sm_efficiency") is not None:
        parts.append(f"est. SM efficiency {_pct(g['sm_efficiency'])}")
    if g.get("achieved_occupancy") is not None:
        parts.append(f"est. achieved occupancy {_pct(g['achieved_occupancy'])}")
    if g.get("tensor_core_pct") is not None:
        parts.append(f"kernel time on tensor cores {_pct(g['tensor_core_pct'])}")
    return " · ".join(parts)


def _temporal_line(t: dict[str, Any]) -> str:
    idle = t.get("idle_breakdown") or {}
    text = (
        f"idle {_pct(t.get('idle_pct'), 2)} · compute {_pct(t.get('compute_pct'), 2)} · "
        f"non-compute {_pct(t.get('non_compute_pct'), 2)} of {_us(t.get('span_us'))}"
    )
    if idle:
        text += (
            f"; idle: host wait {_pct(idle.get('host_wait_pct'), 0)}, kernel wait "
            f"{_pct(idle.get('kernel_wait_pct'), 0)}, other {_pct(idle.get('other_pct'), 0)}"
        )
    if t.get("last_step_excluded"):
        text += " (last step excluded)"
    return text


def _launch_line(launch: dict[str, Any]) -> str | None:
    if not launch.get("kernels"):
        return None
    text = (
        f"{launch.get('kernels_per_step', 0):,.0f} kernels per step, median "
        f"{_us(launch.get('kernel_median_us'))}; {_pct(launch.get('short_kernel_pct'), 0)} under "
        f"{launch.get('short_kernel_threshold_us', 10):.0f} µs "
        f"({_pct(launch.get('short_kernel_time_pct'), 1)} of kernel time)"
    )
    delay = launch.get("launch_delay_us")
    if delay:
        text += (f"; launch→start delay median {_us(delay.get('median'))}, "
                 f"p90 {_us(delay.get('p90'))}")
    if launch.get("launch_call_mean_us") is not None:
        text += f"; launch call {_us(launch['launch_call_mean_us'])} each"
    return text


def _count_per_step(kind: dict[str, Any]) -> str:
    """"2× a step (12 in the trace)," where the record has the count a step, else the
    trace's count as before."""
    per_step = kind.get("count_per_step")
    if not isinstance(per_step, int | float):
        return f"{kind['count']}×,"
    return f"{per_step:.3g}× a step ({kind['count']} in the trace),"


def _memcpy_lines(memcpy: dict[str, Any]) -> list[str]:
    lines = []
    for k in (memcpy.get("kinds") or [])[:4]:
        where = f" ({k['src']} → {k['dst']})" if k.get("src") else ""
        bw = f", {k['gb_per_s']:.1f} GB/s" if k.get("gb_per_s") else ""
        lines.append(
            f"{k['kind']}{where}: {_count_per_step(k)} {_us(k.get('per_step_us'))} per "
            f"step{bw}"
            + ("  ← pageable" if k.get("pageable") else "")
        )
    return lines


def _sync_line(sync: dict[str, Any]) -> str | None:
    calls = sorted((c for c in sync.get("calls") or [] if c.get("per_step")),
                   key=lambda c: -(c.get("per_step_us") or 0.0))
    if not calls:
        return None
    parts = [f"{c['name']} {c['per_step']:.2g}/step ({_us(c.get('per_step_us'))})"
             for c in calls[:3]]
    return f"{_pct(sync.get('share_pct'))} of step time blocked: " + ", ".join(parts)


def _ops_table(doc: dict[str, Any], n: int = 12) -> Table | None:
    ops = (doc.get("operators") or [])[:n]
    if not ops:
        return None
    device = any(op.get("device_self_us") for op in ops)
    table = Table(box=None, padding=(0, 1), header_style="bold", title_justify="left")
    table.add_column("operator", overflow="ellipsis", no_wrap=True, max_width=48)
    table.add_column("calls", justify="right")
    table.add_column("CPU self", justify="right")
    table.add_column("CPU total", justify="right")
    if device:
        table.add_column("device self", justify="right")
        table.add_column("device total", justify="right")
    for op in ops:
        row = [str(op["name"]), f"{op['calls']:,}", _us(op["host_self_us"]),
               _us(op["host_total_us"])]
        if device:
            row += [_us(op["device_self_us"]), _us(op["device_total_us"])]
        table.add_row(*row)
    return keep_numbers_whole(table, cut="operator")


def _memory_line(name: str, d: dict[str, Any]) -> str:
    parts = []
    if d.get("peak_allocated_bytes") is not None:
        peak = f"peak allocated {fmt_bytes(d['peak_allocated_bytes'])}"
        if d.get("peak_reserved_bytes"):
            peak += f" (reserved {fmt_bytes(d['peak_reserved_bytes'])})"
        parts.append(peak)
    else:
        parts.append(f"peak growth {fmt_bytes(d.get('peak_growth_bytes'))} (no allocator totals)")
    if d.get("allocs_per_step") is not None:
        parts.append(f"{d['allocs_per_step']:,.0f} allocations, "
                     f"{fmt_bytes(d.get('alloc_bytes_per_step'))} per step")
    else:
        parts.append(f"{d.get('allocations', 0):,} allocations, {fmt_bytes(d.get('alloc_bytes'))}")
    pct = d.get("in_operators_pct")
    if pct is not None and pct < 99.5:
        parts.append(f"{_pct(pct, 0)} of it inside operators")
    return f"{name}: " + " · ".join(parts)


def _memory_table(doc: dict[str, Any], n: int = 10) -> Table | None:
    ops = ((doc.get("memory") or {}).get("operators") or [])[:n]
    if not ops:
        return None
    sides = [side for side in ("device", "host") if any(op.get(f"{side}_allocs") for op in ops)]
    table = Table(box=None, padding=(0, 1), header_style="bold")
    table.add_column("operator", overflow="ellipsis", no_wrap=True, max_width=48)
    table.add_column("calls", justify="right")
    label = {"device": "device", "host": "host"}
    for side in sides:
        table.add_column(f"{label[side]} self", justify="right")
        table.add_column(f"{label[side]} total", justify="right")
        table.add_column("allocs", justify="right")
    for op in ops:
        row = [str(op["name"]), f"{op['calls']:,}"]
        for side in sides:
            row += [fmt_bytes(op.get(f"{side}_alloc_bytes")),
                    fmt_bytes(op.get(f"{side}_alloc_total_bytes")),
                    f"{op.get(f'{side}_allocs', 0):,}"]
        table.add_row(*row)
    return keep_numbers_whole(table, cut="operator")


def _kernels_table(doc: dict[str, Any], n: int = 10) -> Table | None:
    kernels = (doc.get("kernels") or [])[:n]
    if not kernels:
        return None
    table = Table(box=None, padding=(0, 1), header_style="bold")
    table.add_column("kernel", overflow="ellipsis", no_wrap=True, max_width=58)
    table.add_column("calls", justify="right")
    table.add_column("total", justify="right")
    table.add_column("share", justify="right")
    table.add_column("mean", justify="right")
    table.add_column("occupancy", justify="right")
    table.add_column("TC", justify="center")
    for k in kernels:
        table.add_row(
            str(k["name"]), f"{k['calls']:,}", _us(k["total_us"]), _pct(k["share_pct"]),
            _us(k["mean_us"]),
            _pct(k["occupancy_pct"], 0) if k.get("occupancy_pct") is not None else "—",
            "yes" if k.get("tensor_cores") else "",
        )
    return keep_numbers_whole(table, cut="kernel", keep=("TC",))


def _one_job(doc: dict[str, Any]) -> bool:
    """False for a folder of separate runs' traces (analyse.py's ``one_job``)."""
    return (doc.get("rank_spread") or {}).get("one_job") is not False


def _trace_name(doc: dict[str, Any], rank: Any) -> str:
    """The file name of a folder's trace ``rank`` (its number in file order)."""
    source = ((doc.get("ranks") or {}).get(str(rank)) or {}).get("source")
    return Path(str(source)).name if source else str(rank)


def _ranks_table(doc: dict[str, Any]) -> Table | None:
    ranks = doc.get("ranks")
    if not ranks:
        return None
    table = Table(box=None, padding=(0, 1), header_style="bold")
    one_job = _one_job(doc)
    table.add_column("rank" if one_job else "trace", justify="right" if one_job else "left")
    for col in ("step time", "Kernel", "Comm.", "DataLoader", "CPU Exec", "GPU idle"):
        table.add_column(col, justify="right")
    for r, d in ranks.items():
        pct = d.get("breakdown_pct") or {}
        t = (d.get("temporal") or {}).get(str(d.get("rank"))) or {}
        table.add_row(
            str(r) if one_job else _trace_name(doc, r),
            _us((d.get("step_time_us") or {}).get("mean")), _pct(pct.get("Kernel")),
            _pct(pct.get("Communication")), _pct(pct.get("DataLoader")), _pct(pct.get("CpuOp")),
            _pct(t.get("idle_pct")),
        )
    return keep_numbers_whole(table)


def flops_line(flops: dict[str, Any] | None) -> str | None:
    """The "FLOPs" row: the products' and attention's FLOPs, their kernels' time and rate,
    and for each dtype with a tenth of their kernel time or more, the share of the GPU's
    datasheet peak (trace/op_flops.py)."""
    if not flops:
        return None
    text = (f"{fmt_flops(flops['gflops'] * 1e9)} in products, attention and convolutions "
            f"over {_us(flops['kernel_us'])} of their "
            f"{'CPU time' if flops.get('time_basis') == 'cpu op' else 'kernels'}: "
            f"{fmt_flops((flops['tflops_per_s'] or 0) * 1e12)}/s")
    for k in flops.get("by_dtype") or []:
        if (k.get("of_datasheet_peak") is not None
                and k["kernel_us"] >= 0.1 * (flops["kernel_us"] or 0)):
            text += (f"; {k['dtype']} at {k['of_datasheet_peak'] * 100:.1f}% of the "
                     f"{k['datasheet_gpu']} datasheet's dense peak "
                     f"({k['datasheet_tflops_per_s']:,.0f} TFLOP/s)")
    left = flops.get("uncounted") or []
    if left:
        names = ", ".join(f"{u['name'].removeprefix('aten::')} {u['calls']}×" for u in left[:3])
        text += (f"; not counted: {names} ({_us(sum(u['kernel_us'] for u in left))} of "
                 "their time), whose shapes in this trace do not say their FLOPs (a "
                 "convolution's stride: traces before torch 2.x lack it)")
    return text


def attention_line(att: dict[str, Any] | None) -> str | None:
    """The "Attention" row: attention computed op by op, its kernel time by op
    (trace/attention.py)."""
    if not att or not att.get("shapes"):
        return None
    top = att["shapes"][0]
    ops = ", ".join(f"{name.removeprefix('aten::')} {_us(us)}"
                    for name, us in list((top.get("kernel_us_by_op") or {}).items())[:4])
    share = att.get("kernel_share")
    return (f"op by op on {top['batch']}×{top['query_len']}×{top['key_len']} scores "
            f"({top['dtype']}, heads of {top['head_dim']}): {_us(att['kernel_us'])} of kernels"
            + (f", {share * 100:.0f}% of all" if share is not None else "")
            + (f" ({ops})" if ops else ""))


def _flops_table(doc: dict[str, Any], n: int = 8) -> Table | None:
    calls = ((doc.get("flops") or {}).get("calls") or [])[:n]
    if not calls:
        return None
    table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
    for col, justify in (("op", "left"), ("shapes", "left"), ("dtype", "left"),
                         ("calls", "right"), ("GFLOP", "right"), ("kernel", "right"),
                         ("TFLOP/s", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    for c in calls:
        shape = (f"B={c['B']} M={c['M']} N={c['N']} K={c['K']}" if c.get("M") is not None
                 else " ".join(str(d) for d in c.get("input_dims") or [] if d))
        name = c["name"].removeprefix("aten::").removeprefix("_scaled_dot_product_")
        table.add_row(name, shape, str(c["dtype"]),
                      str(c["calls"]), f"{c['gflops']:.3g}", _us(c["kernel_us_mean"]),
                      f"{c['tflops_per_s_mean']:.3g}")
    return keep_numbers_whole(table)


def render_trace(result: dict[str, Any], file: IO[str] | None = None) -> None:
    """Print the analysis of a trace: summary, breakdown, GPU, HTA, tables, then findings."""
    out = file if file is not None else sys.stdout
    console = make_console(out)
    console.print(_header(result))

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    grid.add_row("Steps", _steps_text(result))
    console.print(grid)
    console.print(Text("Step-time breakdown (TensorBoard plugin definition, average per step)",
                       style="bold"))
    console.print(_breakdown_table(result))

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    device_type = (result.get("format") or {}).get("device_type")
    label = "GPU" if device_type in (None, "CUDA", "ROCm") else str(device_type)
    for dev, g in (result.get("gpu") or {}).items():
        grid.add_row(f"{label} {dev}", _gpu_line(g))
    for rank, t in (result.get("temporal") or {}).items():
        if t:
            grid.add_row(f"HTA rank {rank}", _temporal_line(t))
    for label, text in (("Kernels", _launch_line(result.get("launch") or {})),
                        ("FLOPs", flops_line(result.get("flops"))),
                        ("Attention", attention_line(result.get("attention")))):
        if text:
            grid.add_row(label, text)
    for i, line in enumerate(_memcpy_lines(result.get("memcpy") or {})):
        grid.add_row("Memcpy" if i == 0 else "", line)
    sync = _sync_line(result.get("sync") or {})
    if sync:
        grid.add_row("Syncs", sync)
    comm = result.get("communication")
    if comm:
        grid.add_row(
            "Communication",
            f"{_us(comm.get('communication_us'))} per step, "
            f"{_pct(comm.get('overlap_pct_of_communication'), 0)} overlapped with computation, "
            f"{_us(comm.get('exposed_communication_us'))} exposed",
        )
    memory = result.get("memory") or {}
    for i, (dev, d) in enumerate((memory.get("devices") or {}).items()):
        grid.add_row("Memory" if i == 0 else "", _memory_line(dev, d))
    dl = result.get("dataloader") or {}
    if dl.get("calls"):
        grid.add_row(
            "DataLoader",
            f"{dl['calls']} batches, {_us(dl.get('mean_us'))} each"
            + (f" ({dl['iterators'][0].split('#', 1)[-1]})" if dl.get("iterators") else ""),
        )
    spread = result.get("rank_spread")
    if spread and _one_job(result):
        grid.add_row(
            "Ranks",
            f"step time spread {_pct(spread.get('spread_pct'))} (slowest rank "
            f"{spread.get('slowest_rank')}, fastest {spread.get('fastest_rank')})",
        )
    elif spread:
        means = spread.get("step_time_mean_us") or {}
        grid.add_row(
            "Traces",
            f"{len(means)} separate runs, mean step time: " + " · ".join(
                f"{_trace_name(result, r)} {_us(m)}" for r, m in means.items()),
        )
    findings = result.get("findings") or []
    grid.add_row(
        "Findings",
        f"{len(findings)}, highest estimated gain first (below)" if findings
        else "none: no rule fired above its reporting threshold",
    )
    for note in list(result.get("warnings") or []) + list(result.get("notes") or []):
        grid.add_row("Note", str(note))
    if result.get("merged_note"):
        grid.add_row("Note", str(result["merged_note"]))
    console.print(grid)

    ranks = _ranks_table(result)
    if ranks is not None:
        console.print(Text("\nPer rank" if _one_job(result) else "\nPer trace", style="bold"))
        console.print(ranks)
    table = _flops_table(result)
    if table is not None:
        console.print(Text("\nMatrix products, attention and convolutions by shape, longest "
                           "kernel time first (TraceLens's definitions)", style="bold"))
        console.print(table)
    ops = _ops_table(result)
    if ops is not None:
        console.print(Text("\nTop operators", style="bold")
                      + Text(" (self = excluding child ops; device = work they launched)",
                             style="dim"))
        console.print(ops)
    mem_ops = _memory_table(result)
    if mem_ops is not None:
        console.print(Text("\nTop operators by memory", style="bold")
                      + Text(" (bytes allocated; self = by the op itself, total = with the ops "
                             "it calls)", style="dim"))
        console.print(mem_ops)
    kernels = _kernels_table(result)
    if kernels is not None:
        console.print(Text("\nTop kernels", style="bold"))
        console.print(kernels)
    for i, f in enumerate(findings, 1):
        _print_finding(console, i, f)
