"""The terminal summary of a run (rich). It renders a summary document; it computes nothing."""

from __future__ import annotations

import os
import sys
from typing import IO, Any

from rich.cells import cell_len
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from trainprof.analysis.ddp import judgeable
from trainprof.report.command_lines import verify_parts
from trainprof.report.console import make_console, print_command, print_prose
from trainprof.report.impact import impact_text

_PHASE_STYLE = {
    "data_wait": ("data wait", "red"),
    "forward": ("forward", "green"),
    "backward": ("backward", "blue"),
    "optimizer": ("optimizer", "magenta"),
    "gc": ("gc", "yellow"),
    "other": ("other", "white"),
}


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def regions_in_other(summary: dict[str, Any]) -> str:
    """The named regions' part of the breakdown's "other" (``"region eval 16.2%"``), or "".

    The JSON ``breakdown`` keeps its six phases (regions inside "other"; the split is in
    ``breakdown_detail``): a report shows the part, or an evaluation reads as "other"."""
    share = float((summary.get("breakdown_detail") or {}).get("region") or 0.0)
    if share < 0.0005:
        return ""
    names = list(summary.get("regions") or {})
    return f"{f'region {names[0]}' if len(names) == 1 else 'regions'} {share * 100:.1f}%"


def fmt_bytes(n: float | None) -> str:
    """Bytes in powers of 1024, labelled as such (IEC 80000-13: KiB, MiB, GiB), as
    ``nvidia-smi`` and ``torch.cuda.memory_summary`` print memory: "16.0 MB" for 2**24
    bytes would be 5% off."""
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_flops(n: float | None) -> str:
    """FLOPs (or FLOP/s, with the caller's suffix) in engineering units: 1.29 GFLOP."""
    if n is None:
        return "—"
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}FLOP"
    return f"{n:.3g} FLOP"


def compute_text(compute: dict[str, Any] | None) -> str | None:
    """The "Compute" row: FLOPs a step, the rate, the share of the measured peak, and on a
    GPU with a datasheet figure the MFU against it."""
    if not compute:
        return None
    text = (f"{fmt_flops(compute['flops_per_step'])} a step · "
            f"{fmt_flops(compute['flops_per_s'])}/s")
    kinds = [k for k in compute.get("kinds") or [] if k.get("peak_flops_per_s")]
    if compute.get("utilization") is not None and kinds:
        peaks = ", ".join(f"{k['kind']}: {fmt_flops(k['peak_flops_per_s'])}/s" for k in kinds)
        text += (f" · {utilization_text(compute['utilization'])} of the peak torch.mm reaches here "
                 f"({peaks})")
        if compute.get("model_utilization") is not None:
            text += f" · forward+backward at {utilization_text(compute['model_utilization'])}"
    sheet = compute.get("datasheet_utilization")
    if sheet is not None:
        gpu = next((k["datasheet_gpu"] for k in compute.get("kinds") or []
                    if k.get("datasheet_gpu")), "GPU")
        text += f" · MFU {utilization_text(sheet)} of the {gpu} datasheet's dense peak"
    elif compute.get("utilization") is None:
        text += " · no measured peak to compare with"
    if compute.get("compiled"):
        text += (" · compiled: counted at the products and convolutions its code calls "
                 "(any it generates itself are not)")
    return text


def attention_text(att: dict[str, Any] | None) -> str | None:
    """The "Attention" row: attention computed op by op, its time, and the fused kernel's
    measured ratio (analysis/attention.py)."""
    if not att or not att.get("shapes"):
        return None
    top = att["shapes"][0]
    text = (f"op by op on {top['batch']}×{top['query_len']}×{top['key_len']} scores "
            f"({top['dtype']}, heads of {top['head_dim']}): {att['s_per_step'] * 1e3:.1f} ms a "
            f"step, {att['share'] * 100:.0f}%")
    if top.get("fused_ratio") is not None:
        text += (f" · scaled_dot_product_attention measured here at {top['fused_ratio']:.2f}× "
                 "their time")
    return text


def compiles_text(info: dict[str, Any] | None) -> str | None:
    """The "Compile" row: torch.compile's compilations, those after the warm-up (at which
    steps, how long) and a frame that hit the recompile limit (analysis/compiles.py)."""
    if not info:
        return None
    n = int(info.get("count") or 0)
    text = f"{n} compilation{'s' if n != 1 else ''} ({fmt_time(info.get('seconds'))})"
    after = int(info.get("after_warmup") or 0)
    if after:
        steps = [str(s) for s in info.get("steps_after_warmup") or []]
        shown = ", ".join(steps[:6]) + (", ..." if len(steps) > 6 else "")
        text += (f", {after} after the warm-up, at steps {shown} "
                 f"({fmt_time(info.get('after_warmup_s'))})")
    else:
        text += ", none after the warm-up"
    if info.get("limit_hit"):
        text += (f" · recompile limit ({info.get('recompile_limit')}) hit at step "
                 f"{info.get('limit_hit_step')}: uncompiled since")
    return text


def op_time_text(timed: dict[str, Any] | None) -> str | None:
    """The "Model ops" row: forward and backward's op time a step by kind (products,
    attention, pointwise and other fusable ops, views), from the op count's window.

    Every share is of forward+backward, the seconds the row opens with, time outside
    torch's ops included, so the parts sum to 100%: the kinds' shares of the ops' own time
    beside the outside part's share of forward+backward had summed to 128%."""
    if not timed:
        return None
    labels = (("product", "products"), ("fused_attention", "fused attention"),
              ("attention", "attention"), ("lookup", "embedding lookups"),
              ("fusable", "pointwise/reductions/norms"), ("view", "views"))
    seconds = timed.get("s_per_step") or {}
    total = timed.get("model_s_per_step")
    if not isinstance(total, int | float) or total <= 0:
        return None

    def share(s: float) -> str:
        # a sliver is said as one, not as 0% beside its microseconds
        return "<1%" if 0 < s / total < 0.005 else f"{s / total * 100:.0f}%"

    parts = [f"{label} {fmt_time(seconds[k])} ({share(seconds[k])})"
             for k, label in labels if seconds.get(k)]
    outside = timed.get("outside_ops_s_per_step")
    # below 1% it is the clock's rounding, not Python between the ops
    if isinstance(outside, int | float) and outside >= 0.01 * total:
        parts.append(f"outside torch's ops {fmt_time(outside)} ({share(outside)})")
    load = timed.get("outside_load_cores")
    return (f"forward+backward {fmt_time(total)} a step, by kind of op (share of "
            "forward+backward): " + " · ".join(parts)
            + (" (CUDA events)" if timed.get("timed_by") == "cuda events" else "")
            + (f" · timed while other processes kept ~{load:.1f} cores busy: the split may "
               "be off" if timed.get("disturbed") and isinstance(load, int | float) else ""))


def utilization_text(x: float) -> str:
    """A utilization: one decimal below 10% (an input-bound step is at 0.4%, not 0%)."""
    return f"{x * 100:.1f}%" if x < 0.095 else f"{x * 100:.0f}%"


def fmt_pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}%"


def _breakdown_bar(breakdown: dict[str, float], width: int = 40) -> Text:
    """The shares as one bar of ``width`` cells: cumulative rounding, so the cells of the
    phases add up to the width (rounding each share alone gave 41 cells for six shares)."""
    bar = Text()
    total = 0.0
    drawn = 0
    for key, (_, style) in _PHASE_STYLE.items():
        total += breakdown.get(key, 0.0)
        n = round(total * width) - drawn
        if n > 0:
            bar.append("█" * n, style=style)
            drawn += n
    return bar


def _status_line(s: dict[str, Any]) -> Text:
    status = s.get("status")
    color = {"finished": "green", "crashed": "red", "interrupted": "yellow"}.get(status, "cyan")
    line = Text("trainprof ", style="bold")
    line.append(str(s.get("name") or ""), style="bold")
    line.append("  ")
    line.append(str(status), style=f"bold {color}")
    if s.get("exit_code") is not None:
        line.append(f" (exit {s['exit_code']})")
    if s.get("duration_s") is not None:
        line.append(f"  {s['duration_s']:.1f} s wall")
    return line


#: The most of an exception's message the report's first line shows (the record keeps more).
_MESSAGE_SHOWN = 300


def crash_head(crash: dict[str, Any]) -> str:
    """An exception's first line: ``RuntimeError: boom at train.py:12 in <module>, step 80``
    (the step the run was in: the steps complete before it). The message's first line, cut
    to :data:`_MESSAGE_SHOWN` characters: the row, or the HTML's headline, stays readable."""
    message = str(crash.get("message") or "")
    first = message.split("\n", 1)[0]
    if len(first) > _MESSAGE_SHOWN:
        first = first[:_MESSAGE_SHOWN]
    if first != message:
        first += " ..."
    head = f"{crash['exception']}: {first}" if first else str(crash["exception"])
    site = crash.get("site")
    if isinstance(site, dict) and site.get("file"):
        head += (f" at {os.path.basename(str(site['file']))}:{site.get('line')} "
                 f"in {site.get('function')}")
    step = crash.get("step")
    head += f", step {step}" if isinstance(step, int) else ", before the first step"
    return head


def crash_text(crash: dict[str, Any] | None) -> str:
    """``SIGSEGV (Segmentation fault) in its Python stack:`` (or ``RuntimeError: ... at
    train.py:12 in <module>, step 80`` for an exception the script raised) and the frames,
    one a line, the crash site last, as a Python traceback lists them."""
    if not crash:
        return ""
    if crash.get("exception"):
        head = crash_head(crash)
        frames = crash.get("frames") or []
        if len(frames) < 2:  # the site says it all
            return head
        lines = [f"{head}; the traceback, most recent call last:"]
        if crash.get("more"):
            lines.append(f"  ... {crash['more']} outer frames")
        lines += [f"  {file}:{line} in {func}" for file, line, func in frames]
        return "\n".join(lines)
    head = f"{crash['signal']} ({crash['message']})" if crash.get("message") else crash["signal"]
    frames = crash.get("frames") or []
    if not frames:
        return f"{head}, with no Python frame of the script on the crashing thread"
    lines = [f"{head}; the crashing thread's Python stack, most recent call last:"]
    if crash.get("more"):
        lines.append(f"  ... {crash['more']} outer frames")
    lines += [f"  {file}:{line} in {func}" for file, line, func in frames]
    return "\n".join(lines)


def _optimizer_rows(optimizers: list[dict[str, Any]]) -> list[str]:
    """One line per kind of optimizer: a script that builds one per epoch gets one line,
    with the count."""
    lines: dict[str, int] = {}
    for opt in optimizers:
        line = _optimizer_line(opt, several=len(optimizers) > 1)
        lines[line] = lines.get(line, 0) + 1
    return [line if n == 1 else f"{line} · {n} optimizers like it" for line, n in lines.items()]


def _optimizer_line(opt: dict[str, Any], several: bool = False) -> str:
    """``AdamW · for-loop over 100 tensors (270,026 parameters, cpu)``."""
    name = str(opt.get("class") or "?").rsplit(".", 1)[-1]
    if opt.get("error"):
        return f"{name} (not described: {opt['error']})"
    impl = opt.get("implementation")
    how = ("its own step" if impl is None else
           "/".join(impl) if isinstance(impl, list) else str(impl))
    where = ", ".join(opt.get("devices") or [])
    line = (f"{name} · {how} over {opt.get('param_tensors', 0):,} tensors "
            f"({opt.get('numel', 0):,} parameters{', ' + where if where else ''})")
    if several and opt.get("primary"):
        line += " · its steps delimit steps"
    return line


def _ddp_rows(models: list[dict[str, Any]]) -> list[str]:
    """Each DDP model: its buckets, and its all-reduce as DDP's reducer timed it."""
    rows = []
    for m in models:
        buckets = m.get("buckets")
        size = m.get("gradient_bytes")
        head = (f"{m.get('module') or '?'} · {m.get('backend') or '?'} × "
                f"{m.get('world_size') or '?'} ranks · "
                + (f"{buckets} bucket{'s' if buckets != 1 else ''} " if buckets else "")
                + (f"({fmt_bytes(size)} of gradients)" if size else ""))
        if m.get("comm_hook"):
            head += f" · {m['comm_hook']}"
        if m.get("find_unused_parameters"):
            head += " · find_unused_parameters"
        if isinstance(m.get("comm_ms"), int | float):
            share = m.get("exposed_share")
            its = m.get("iterations") or []
            head += (f" · all-reduce {m['comm_ms']:.1f} ms a step, {m['overlap_ms']:.1f} ms "
                     f"under backward, {m['exposed_ms']:.1f} ms exposed"
                     + (f" ({share * 100:.0f}% of step)" if isinstance(share, float) else
                        " (no share of the step: DDP timed no steady iteration)"
                        if m.get("share_withheld") else "")
                     + f"  (DDP's timing of iteration{'s' if len(its) != 1 else ''} "
                     + ", ".join(map(str, its[:4])) + ("..." if len(its) > 4 else "") + ")"
                     + ("" if judgeable(m) else
                        ": too few past DDP's warm-up for a finding (a longer run samples "
                        "more)"))
        rows.append(head)
    return rows


def _dataloader_line(dl: dict[str, Any]) -> str:
    if "error" in dl:
        return f"#{dl.get('index')}: {dl['error']}"
    dataset = (dl.get("dataset") or "?").rsplit(".", 1)[-1]
    parts = [
        f"{dataset}(len={dl.get('len')})",
        _batch_size_txt(dl),
        f"num_workers={dl.get('num_workers')}",
        f"pin_memory={dl.get('pin_memory')}",
    ]
    if dl.get("num_workers"):
        parts += [
            f"prefetch_factor={dl.get('prefetch_factor')}",
            f"persistent_workers={dl.get('persistent_workers')}",
        ]
    line = ", ".join(parts)
    together = [i for i in dl.get("iterated_with") or [] if isinstance(i, int)]
    if together:  # zipped in one loop: each step waits on all of them (capture/hooks.py)
        line += " · iterated together with " + ", ".join(f"#{i}" for i in together)
    return line


def _batch_size_txt(dl: dict[str, Any]) -> str:
    """``batch_size=N``; a loader given a batch_sampler has None there: say what batches."""
    size = dl.get("batch_size")
    if size is None and dl.get("batch_sampler_batch_size") is not None:
        sampler = (dl.get("batch_sampler") or "?").rsplit(".", 1)[-1]
        return f"batch_size={dl['batch_sampler_batch_size']} (its batch_sampler {sampler})"
    return f"batch_size={size}"


def _explicit_gc_txt(explicit: dict[str, Any] | None) -> str:
    """`` · the script's gc.collect(): 12 calls, 2.09 s`` (capture/explicit_gc.py)."""
    if not explicit or not explicit.get("calls"):
        return ""
    n = int(explicit["calls"])
    return (f" · the script's gc.collect(): {n} call{'' if n == 1 else 's'}, "
            f"{fmt_time(float(explicit.get('total_s') or 0))}")


def _ms_txt(stats: dict[str, Any] | None) -> str:
    stats = stats or {}
    med, p90 = stats.get("median"), stats.get("p90")
    if med is None:
        return "—"
    return f"{fmt_time(med / 1e3)} (p90 {fmt_time(p90 / 1e3)})" if p90 is not None else (
        fmt_time(med / 1e3))


def _batches_read(entry: dict[str, Any]) -> str:
    """"40 batches read", or "12 of 40 batches read held padded sequences" when only some
    did (the others held none: their shares count nothing)."""
    padded, read = int(entry.get("batches") or 0), int(entry.get("batches_read") or 0)
    if read > padded:
        return f"{padded} of {read} batches read held padded sequences"
    return f"{padded} batch{'es' * (padded != 1)} read"


def _padding_line(entry: dict[str, Any], packed: bool = False) -> str:
    """One loader's padded sequences (trainprof.analysis.padding) in one line; ``packed``:
    the op count saw the model pack its sequences (``pack_padded_sequence``), so its RNN
    runs on the real positions only and the padding costs no compute (no finding follows,
    diagnosis/padding.py)."""
    lo, hi = entry.get("length_min"), entry.get("length_max")
    length = f"{hi}" if lo == hi else f"{lo}-{hi}"
    return (f"{entry.get('tensor')}: {float(entry.get('pad_share') or 0) * 100:.0f}% of "
            f"{length} positions a row are padding · "
            f"{float(entry.get('mean_real') or 0):.0f} real tokens a row, the longest of a "
            f"batch {float(entry.get('mean_longest') or 0):.0f} · {_batches_read(entry)}"
            + (" · the model packs its sequences (pack_padded_sequence): the padding costs "
               "no compute" if packed else ""))


def worker_rows(workers: dict[str, Any] | None,
                 loaders: list[dict[str, Any]] | None = None,
                 handoff: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """What the DataLoader workers (or the training process, num_workers=0) spent time on,
    and what receiving their batches cost the training process (per loader where the
    record keeps it, else all loaders together)."""
    rows: list[tuple[str, str]] = []
    threads = {d.get("index"): d.get("iterated_in_thread") for d in loaders or []}
    # batch_size=None and no batch sampler: each item the dataset gives is a batch already
    whole = {d.get("index") for d in loaders or []
             if "batch_size" in d and d.get("batch_size") is None and not d.get("batch_sampler")}
    for w in (workers or {}).get("loaders") or []:
        if not w.get("samples"):
            continue
        idx = w.get("loader_index")
        if w.get("mode") == "main" and threads.get(idx):
            who = f"in thread {threads[idx]!r} of the training process (num_workers=0)"
        elif w.get("mode") == "main":
            who = "in the training process (num_workers=0)"
        else:
            who = (f"{w.get('num_workers')} workers ({w.get('start_method')}) × "
                   f"{w.get('generations')} generation(s)")
        count = f"{'~' if w.get('samples_estimated') else ''}{w['samples']:,}"
        item = "item" if idx in whole else "sample"
        parts = [
            who,
            (f"{count} items, each a whole batch (batch_size=None)" if idx in whole
             else f"{count} samples"),
            f"per {item} blocked {_ms_txt(w.get('sample_blocked_ms'))}, "
            f"CPU {_ms_txt(w.get('sample_cpu_ms'))}",
            f"collate {_ms_txt(w.get('collate_ms'))}/batch",
        ]
        split = w.get("fetch_split") or {}
        # whose time each share is of: the loading's (fetch_split), the workers' wall time
        # from their first batch to their last (busy_share_active, analysis/workers.py)
        if split.get("waiting_for_cpu"):
            parts.append(f"waiting for a core {split['waiting_for_cpu'] * 100:.0f}% of the "
                         "loading time")
        busy = (w.get("busy_share_active") or {}).get("median")
        if busy is not None:
            parts.append(f"each worker loading {busy * 100:.0f}% of its time (median; the "
                         "rest waiting for the loop to ask for more)")
        startup = w.get("startup") or {}
        if startup.get("median_s") is not None:
            parts.append(f"start-up {fmt_time(startup['median_s'])}")
        rows.append((f"Loading #{idx}", " · ".join(parts)))
        top = [f for f in (w.get("functions") or {}).get("top") or []
               if (f.get("self_share") or 0) >= 0.005]
        if top:
            rows.append(("  hot spots", " · ".join(
                f"{f['function']} ({f['where']}) {(f.get('self_share') or 0) * 100:.0f}%"
                for f in top[:4])))
    if handoff and handoff.get("tensors"):
        # per loader where the record has it: an evaluation loader iterated inside the loop
        # has its own hand-over (2.75 ms a tensor pooled against 0.57 ms for the training
        # loader alone, in an explorer's script); one loader, or older records: pooled
        own = [e for e in handoff.get("loaders") or [] if e.get("tensors")]
        if len(own) < 2:  # one loader's batches only: its row is the pooled one
            own = []
        for entry in own or [handoff]:
            label = (f"Hand-over #{entry.get('loader_index')}" if own else "Hand-over")
            rows.append((label, _handoff_row(
                {**entry, "strategies": entry.get("strategies") or handoff.get("strategies")})))
    return rows


def _handoff_row(handoff: dict[str, Any]) -> str:
    """One hand-over (a loader's, or all loaders' pooled) as a row's value."""
    per_batch = handoff.get("tensors_per_batch")
    parts = [f"{handoff['tensors']:,} tensors"
             + ((f" (~{per_batch:.1f} a batch)" if handoff.get("tensors_per_batch_estimated")
                 else f" ({per_batch:.0f} a batch)") if per_batch else ""),
             f"{fmt_time(float(handoff.get('mean_ms') or 0) / 1e3)} each (median "
             f"{fmt_time(float(handoff.get('median_ms') or 0) / 1e3)})"]
    share = handoff.get("training_thread_share")
    if share is not None:
        parts.append(f"training thread {share * 100:.1f}% of step time")
    parts.append("/".join(handoff.get("strategies") or []) or "—")
    return _PART_SEP.join(parts)


#: what separates the parts of a summary value ("1,920 samples · per sample ...")
_PART_SEP = " · "


#: Ranks listed one per line; more are counted (a 64-GPU job needs --json or the HTML).
MAX_RANK_ROWS = 16


def _own_findings(r: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """What another rank's own diagnosis found that the merged view does not show (the
    main rank's are the merged view's)."""
    if r.get("label") == summary.get("main_rank"):
        return []
    shown = {f"{f.get('category')}/{f.get('cause')}" for f in summary.get("findings") or []}
    return [f for f in r.get("findings") or [] if f not in shown
            and not f.startswith("measurement_noise")]


def _rank_reports(summary: dict[str, Any]) -> list[str]:
    """``trainprof report RANK_DIR`` of each rank listed with findings of its own (its row
    says "its report: below"), to print under the table: in a cell the command would wrap."""
    rows = dict(_rank_rows(summary))
    return [f"trainprof report {r['run_dir']}" for r in summary.get("ranks") or []
            if r.get("run_dir") and f"Rank {r.get('label')}" in rows
            and _own_findings(r, summary)]


def _rank_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """A line per rank of a merged run (analysis.ranks), then how far apart they are."""
    rows: list[tuple[str, str]] = []
    ranks = summary.get("ranks") or []
    # processes that ran no step (helpers the script started) get one line together,
    # unless no process stepped at all, or one of them did not finish
    idle = [r for r in ranks if not r.get("steps") and r.get("status") == "finished"]
    if not (summary.get("steps") or {}).get("count"):
        idle = []
    shown = [r for r in ranks if r not in idle]
    for r in shown[:MAX_RANK_ROWS]:
        parts = [str(r.get("status"))]
        if r.get("exit_code") not in (0, None):
            parts[0] += f" (exit {r['exit_code']})"
        if r.get("rank") is not None and str(r["rank"]) != r["label"]:
            parts.append(f"torch.distributed rank {r['rank']}")
        if r.get("steps"):
            parts.append(f"{r['steps']} steps")
        else:
            parts.append("no step")
        if r.get("median_s") is not None:
            parts.append(f"median {fmt_time(r['median_s'])} (p90 {fmt_time(r['p90_s'])})")
        if r.get("data_wait") is not None and r.get("steps"):
            parts.append(f"data wait {r['data_wait'] * 100:.1f}%")
        if r.get("samples_per_s"):
            parts.append(f"{r['samples_per_s']:,.0f} samples/s")
        # what another rank's own diagnosis found that the figures above do not show
        extra = _own_findings(r, summary)
        if extra:
            parts.append(f"its own findings: {', '.join(extra[:3])}"
                         + (" (its report: below)" if r.get("run_dir") else ""))
        rows.append((f"Rank {r['label']}", " · ".join(parts)))
    if len(shown) > MAX_RANK_ROWS:
        rows.append(("", f"... {len(shown) - MAX_RANK_ROWS} more ranks (every one in --json)"))
    if idle:
        labels = ", ".join(r["label"] for r in idle[:8]) + (", ..." if len(idle) > 8 else "")
        rows.append(("Processes", f"{len(idle)} started by the script ran no step "
                                  f"(ranks/ {labels}): helpers, not training"))
    spread = summary.get("rank_spread")
    if spread:
        parts = []
        if spread.get("spread_pct") is not None:
            parts.append(f"mean step {spread['spread_pct']:.0f}% apart over "
                         f"{spread['common_steps']} shared steps (slowest rank "
                         f"{spread['slowest_rank']}, fastest {spread['fastest_rank']})")
        if spread.get("data_wait_spread_s"):
            waits = spread["data_wait_s"]
            most, least = spread["most_data_wait_rank"], spread["least_data_wait_rank"]
            parts.append(f"data wait per step {fmt_time(waits[most])} (rank {most}) to "
                         f"{fmt_time(waits[least])} (rank {least})")
        if parts:
            rows.append(("Ranks", " · ".join(parts)))
    return rows


def _fit(value: str, room: int) -> str:
    """Break a long value between its parts so each line fits in ``room`` columns.

    rich wraps at any space, which can leave a number at the end of one line and
    its unit at the start of the next ("CPU 292" / "µs"); breaking between parts
    first leaves rich only parts longer than a whole line to wrap. A broken line
    ends with the separator's dot, and is kept short enough to hold it.
    """
    if "\n" in value:  # a row of several lines (one per DataLoader): each line its own
        return "\n".join(_fit(line, room) for line in value.split("\n"))
    if room < 20 or cell_len(value) <= room:
        return value
    tail = _PART_SEP.rstrip()  # " ·" at the end of a broken line
    lines: list[str] = []
    line = ""
    for part in value.split(_PART_SEP):
        joined = f"{line}{_PART_SEP}{part}" if line else part
        if line and cell_len(joined + tail) > room:
            lines.append(line + tail)
            line = part
        else:
            line = joined
    lines.append(line)
    return "\n".join(lines)


class _Rows:
    """The summary's label/value rows, laid out for the console's width when printed."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str | Text]] = []

    def add_row(self, label: str, value: str | Text) -> None:
        self.rows.append((label, value))

    def layout(self, width: int) -> Table:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        room = width - max((len(label) for label, _ in self.rows), default=0) - 2
        for label, value in self.rows:
            # text, never markup: a code line such as `x[i + 1 : j]` is not a rich style
            table.add_row(label, Text(_fit(value, room)) if isinstance(value, str) else value)
        return table


def render_summary(summary: dict[str, Any], file: IO[str] | None = None) -> None:
    """Print the end-of-run summary."""
    out = file if file is not None else sys.stdout
    console = make_console(out)
    console.print(_status_line(summary))
    table = _Rows()
    crash = crash_text(summary.get("crash"))
    if crash:
        table.add_row("Crash", crash)
    steps = summary["steps"]
    if steps["count"] == 0 and steps.get("recorded"):
        table.add_row("Steps", f"none readable: the run recorded {steps['recorded']:,} but "
                               f"its steps.bin holds no whole step record (see the note)")
    elif steps["count"] == 0:
        table.add_row(
            "Steps",
            "none seen: no optimizer step or backward() ran "
            "(is it a training script? use prof.step() to mark steps by hand)",
        )
    else:
        delim = {"optimizer": "optimizer steps", "backward": "backward() calls",
                 "manual": "prof.step()"}.get(steps["delimiter"], str(steps["delimiter"]))
        table.add_row(
            "Steps",
            f"{steps['count']} (warm-up {steps['warmup']}, steady {steps['steady_count']}"
            + (f", profiled {steps['profiled']}" if steps.get("profiled") else "")
            + f"; delimited by {delim}"
            + (f", {steps['skipped']} skipped by GradScaler" if steps.get("skipped") else "")
            + ")",
        )
        warm = (
            f"  (warm-up median {fmt_time(steps['warmup_median_s'])})"
            if steps["warmup_median_s"] is not None
            else ""
        )
        table.add_row(
            "Step time",
            f"median {fmt_time(steps['median_s'])} · p10 {fmt_time(steps['p10_s'])} · "
            f"p90 {fmt_time(steps['p90_s'])}{warm}",
        )
        thr = []
        if summary.get("samples_per_s"):
            rate = f"{summary['samples_per_s']:,.0f} samples/s"
            if summary.get("samples_other_loaders"):
                # an evaluation loader iterated inside the loop: its samples are not trained on
                rate += (f" (training loader's; {summary['samples_other_loaders']:,} samples "
                         "of other loaders left out)")
            thr.append(rate)
        if summary.get("steps_per_s"):
            thr.append(f"{summary['steps_per_s']:,.1f} steps/s")
        if summary.get("samples_per_s_all_ranks"):
            thr.append(f"all ranks {summary['samples_per_s_all_ranks']:,.0f} samples/s")
        mean, median = steps.get("mean_s"), steps.get("median_s")
        if thr and mean and median and mean > 1.5 * median:
            # the throughput is the mean's, the Step time row the median's: say why they differ
            thr.append(f"mean step {fmt_time(mean)}, median {fmt_time(median)}: a few long "
                       "steps weigh")
        table.add_row("Throughput", " · ".join(thr) or "—")
        for label, text in (("Compute", compute_text(summary.get("compute"))),
                            ("Attention", attention_text(summary.get("attention"))),
                            ("Model ops", op_time_text(summary.get("op_time"))),
                            ("Compile", compiles_text(summary.get("compiles")))):
            if text:
                table.add_row(label, text)
    breakdown = summary.get("breakdown")
    if breakdown:
        table.add_row("Breakdown", _breakdown_bar(breakdown))
        parts = Text()
        for key, (label, style) in _PHASE_STYLE.items():
            if parts:
                parts.append(" · ")
            parts.append(f"{label} {breakdown[key] * 100:.1f}%", style=style)
        if regions_in_other(summary):
            parts.append(f" ({regions_in_other(summary)})", style=_PHASE_STYLE["other"][1])
        table.add_row("", parts)
    device = summary.get("device")
    if device:
        b = device["breakdown"]
        table.add_row(
            "GPU time",
            f"median {fmt_time(device['median_step_s'])}/step on the device · forward "
            f"{b['forward'] * 100:.0f}% · backward {b['backward'] * 100:.0f}% · optimizer "
            f"{b['optimizer'] * 100:.0f}% · outside phases (idle if starved) {b['gap'] * 100:.0f}%",
        )
    syncs = summary.get("syncs")
    if syncs and (syncs["per_step"] or syncs["host_reads_per_step"]):
        table.add_row(
            "Host reads",
            f"{syncs['host_reads_per_step']:.2g}/step (.item/.cpu/.tolist/.numpy); "
            f"device syncs {syncs['per_step']:.2g}/step, {syncs['share'] * 100:.1f}% of step time",
        )
    gc_info = summary.get("gc")
    if gc_info and gc_info["collections_per_step"]:
        table.add_row(
            "GC",
            f"{gc_info['collections_per_step']:.2f} collections/step "
            f"({gc_info['gen2_per_step']:.3f} full)" + _explicit_gc_txt(gc_info.get("explicit")),
        )
    for name, reg in (summary.get("regions") or {}).items():
        # wall time: from its start to its end (the breakdown counts only its own time;
        # a note says so where the two differ: analysis/summary.py)
        share = reg.get("steady_share")
        table.add_row(f"Region {name}", f"{reg['count']}× · {fmt_time(reg['total_s'])} wall time"
                      + (f" · {share * 100:.1f}% of the steady steps' time" if share else ""))
    system = summary.get("system") or {}
    if system.get("n_samples"):
        cpu = (
            f"process {fmt_pct(system.get('proc_cpu_pct'))} · "
            f"workers {fmt_pct(system.get('workers_cpu_pct'))} "
            f"({system.get('n_workers_seen', 0)} seen) · "
            f"system {fmt_pct(system.get('sys_cpu_pct'))} of all cores"
        )
        if system.get("iowait_pct") is not None:
            cpu += f" · iowait {fmt_pct(system['iowait_pct'])}"
        cores = (summary.get("environment") or {}).get("usable_cores")
        if cores:
            # the process and its workers in cores (psutil's per-process %), the system
            # as the mean over its cores: the two scales are said apart
            cpu += f"  ({cores} usable cores; process, workers: 100% = one core)"
        table.add_row("CPU", cpu)
        table.add_row("Memory", f"RSS peak {fmt_bytes(system.get('rss_peak_bytes'))}")
        for g in system.get("gpu") or []:
            table.add_row(
                f"GPU {g.get('index')}",
                f"util {fmt_pct(g.get('util_pct'))} · memory peak "
                f"{fmt_bytes(g.get('mem_used_bytes'))} of {fmt_bytes(g.get('mem_total_bytes'))}",
            )
    loaders = [dl for dl in summary.get("dataloaders") or [] if isinstance(dl, dict)]
    for dl in loaders:
        label = f"DataLoader #{dl.get('index')}" if len(loaders) > 1 else "DataLoader"
        table.add_row(label, _dataloader_line(dl))
    for label, line in worker_rows(summary.get("workers"), summary.get("dataloaders"),
                                    summary.get("batch_handoff")):
        table.add_row(label, line)
    ckpt = summary.get("activation_checkpointing") or {}
    if ckpt.get("calls"):
        per_step = ckpt.get("calls_per_step")
        regions = f"{per_step:.0f} regions a step" if per_step else f"{ckpt['calls']:,} regions"
        share = fmt_pct(100 * float(ckpt.get("share") or 0))
        table.add_row("Checkpoint", f"{regions} (torch.utils.checkpoint) · first pass {share} "
                                    "of step time, run again in backward")
    for entry in summary.get("padding") or []:
        if float(entry.get("pad_share") or 0) < 0.01:  # sequences without padding
            continue
        table.add_row(f"Padding #{entry.get('loader_index')}", _padding_line(
            entry, packed=float((summary.get("ops") or {}).get("packed_sequences_per_step")
                                or 0) > 0))
    for line in _optimizer_rows(summary.get("optimizers") or []):
        table.add_row("Optimizer", line)
    if summary.get("optimizers_not_described"):
        table.add_row("Optimizer", f"{summary['optimizers_not_described']:,} more, not "
                                   "described (one is built per epoch or per step?)")
    for line in _ddp_rows(summary.get("ddp") or []):
        table.add_row("DDP", line)
    ev = summary.get("eval_autograd") or {}
    if ev.get("grad_calls") or ev.get("nograd_calls"):
        table.add_row("Eval mode", f"{ev.get('grad_calls', 0):,} model calls with autograd on "
                      f"({fmt_time(ev.get('grad_s'))}), "
                      f"{ev.get('nograd_calls', 0):,} with it off "
                      f"({fmt_time(ev.get('nograd_s'))})")
    env = summary.get("environment") or {}
    if env:
        table.add_row(
            "Environment",
            f"Python {env.get('python')} · torch {env.get('torch')}"
            + (f" · CUDA {env['cuda']} · {env['gpu']}" if env.get("gpu") else " · CPU only")
            + (f" · {env['torch_num_threads']} intra-op thread"
               + ("" if env["torch_num_threads"] == 1 else "s")
               if env.get("torch_num_threads") else ""),
        )
    ops = summary.get("ops")
    if ops and ops.get("calls_per_step") is not None:
        table.add_row(
            "Torch calls",
            f"{ops['calls_per_step']:,.0f} per step from Python (sampled over "
            f"{ops['steps_sampled']} steps)",
        )
    other_line = _other_row(summary)
    if other_line:
        table.add_row("Other", other_line)
    first = first_steps_row(summary)
    if first:
        table.add_row(*first)
    for label, line in _deep_rows(summary.get("deep")):
        table.add_row(label, line)
    for label, line in _rank_rows(summary):
        table.add_row(label, line)
    findings = summary.get("findings") or []
    if findings:
        table.add_row("Findings", f"{len(findings)}, highest estimated gain first (below)")
    elif steps["count"]:
        table.add_row("Findings", "none: no rule fired above its reporting threshold")
    for note in list(summary.get("missing") or []) + list(summary.get("notes") or []):
        table.add_row("Note", str(note))
    table.add_row("Run folder", str(summary.get("run_dir")))
    console.print(table.layout(console.width))
    reports = _rank_reports(summary)
    if reports:
        print_prose(console, "The reports of the ranks with findings of their own:", style="dim")
        for command in reports:
            print_command(console, command, indent=3)
    python_profile = summary.get("python_profile")
    if python_profile:
        from trainprof.report.python_profile_terminal import render_python_profile

        render_python_profile(python_profile, console)
    # Findings go below the table, at full width: fix snippets must not wrap inside a cell.
    for i, f in enumerate(findings, 1):
        _print_finding(console, i, f)
    _print_verify_hint(console, summary, findings)


def _print_verify_hint(console: Console, summary: dict[str, Any],
                       findings: list[dict[str, Any]]) -> None:
    """The verify hint: what it measures, then the command whole on a line of its own."""
    hint = verify_hint(summary, findings)
    if hint:
        prose, command = hint
        console.print()
        print_prose(console, prose, style="bold cyan")
        print_command(console, command, indent=3, style="bold cyan")


def verify_hint(summary: dict[str, Any],
                findings: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(what it measures, the command): the command that measures the first finding a knob
    can measure (``trainprof verify``), for a single-process run (a launch's command is one
    rank's), said as what
    the knob is to the finding: its fix, an aside of a fix that is a code change, or the
    most any input fix can give (experiments/verify.knob_role). For a run that crashed, its
    trials stop before the crash, said so; none where it crashed too soon for verify."""
    from trainprof.experiments.verify import MIN_CRASH_STEPS, crashed_after, knob_role

    run_dir = summary.get("run_dir")
    done = crashed_after(summary)
    if not run_dir or summary.get("ranks") or (done is not None and done < MIN_CRASH_STEPS):
        return None
    command = summary.get("command")
    if isinstance(command, list) and len(command) >= 2 and str(command[1]) in ("-", "-c"):
        return None  # code from stdin or a string: nothing for verify to run again
    for i, f in enumerate(findings, 1):
        verify = str(f.get("verify") or "")
        if "trainprof tune --knob" not in verify:
            continue
        which = "" if i == 1 else f" --finding {i}"
        what, why = {
            "fix": (f"Measure finding {i}'s fix", "its knob on this script, against its "
                    "estimate"),
            "aside": (f"Measure finding {i}'s knob", "an aside: its fix is a code change, "
                      "measured as its verify line says"),
            "bound": (f"Measure the most finding {i}'s fix can give", "the input made free: "
                      "a ceiling, not the fix"),
        }[knob_role(verify)]
        crash = ("" if done is None else
                 f"; the run crashed after {done} steps: its trials stop before that")
        return f"{what} ({why}{crash}):", f"trainprof verify {run_dir}{which}"
    return None


_TB_LABELS = {"Kernel": "kernel", "Memcpy": "memcpy", "Memset": "memset",
              "Communication": "communication", "Runtime": "runtime",
              "DataLoader": "DataLoader", "CpuOp": "CPU ops", "Other": "other"}


def _other_row(summary: dict[str, Any]) -> str | None:
    """Where "other" goes, from the sampled stacks: the loop's top lines (5% of step or more)."""
    stacks = summary.get("loop_stacks") or {}
    rows = (stacks.get("other") or {}).get("lines") or []
    n = int((stacks.get("other") or {}).get("samples") or 0)
    in_syncs = int((stacks.get("other") or {}).get("in_syncs") or 0)
    parts = []
    for r in rows[:3]:
        if r.get("file") is None or (r.get("step_share") or 0.0) < 0.05:
            continue
        parts.append(f"{os.path.basename(r['file'])}:{r['line']} {r.get('source') or ''} "
                     f"{r['share'] * 100:.0f}%")
    if not parts:
        return None
    tail = f", {in_syncs} more inside device syncs" if in_syncs else ""
    loop = stacks.get("loop") or {}
    head = ""
    if loop.get("library"):  # a framework's loop: its lines, then where the script enters it
        called = loop.get("called_from") or {}
        head = f"in {loop.get('function')}, the framework's loop" + (
            f" ({os.path.basename(called['file'])}:{called['line']} runs it)"
            if called.get("file") else "") + ": "
    return head + " · ".join(parts) + f"  (of {n} stack samples in 'other'{tail})"


#: The warm-up of a run with a steady state gets its row once its samples stand for this
#: long (a first step that compiled for minutes); a run without one, whatever they are.
FIRST_STEPS_ROW_S = 5.0


def first_steps_row(summary: dict[str, Any]) -> tuple[str, str] | None:
    """Where the time of a run without a steady state went (its steps are all first
    steps: no "Other" row), or of a long warm-up: the top lines of the user's code the
    samples were on, whatever the phase (:func:`trainprof.analysis.loop_stacks.
    summarize_loop_stacks`' ``first_steps``). Public: the HTML report shows the same row,
    worded the same, so that the two reports never say different things."""
    first = (summary.get("loop_stacks") or {}).get("first_steps") or {}
    rows = first.get("lines") or []
    if not rows:
        return None
    steady = bool(first.get("steady_state"))
    if steady and (first.get("seconds") or 0.0) < FIRST_STEPS_ROW_S:
        return None
    parts = []
    for r in rows[:3]:
        if r.get("share", 0.0) < 0.05 and parts:
            continue
        where = (f"{os.path.basename(r['file'])}:{r['line']} {r.get('source') or ''}"
                 if r.get("file") else "outside the script's own code")
        if r.get("function") and r["function"] != "<module>":
            where += f" (in {r['function']})"
        phases = r.get("by_phase") or {}
        top = max(phases, key=phases.get) if phases else None
        if top and top != "other":
            where += f" [{top}]"
        parts.append(f"{where} {r['share'] * 100:.0f}%")
    n = int(first.get("samples") or 0)
    steps = int(first.get("steps") or 0)
    whose = ("the first step's" if steps == 1 else f"the {steps} warm-up steps'") if steady \
        else ("its one step's" if steps == 1 else f"its {steps} steps'")
    tail = f"{n} stack samples"
    if first.get("seconds") is not None and first.get("step_s"):
        tail += (f", {fmt_time(first['seconds'])} of {whose} {fmt_time(first['step_s'])}: "
                 "a first step is sampled from 1 s into it on")
    label = "Warm-up" if steady else "Where the time went"
    return label, " · ".join(parts) + f"  ({tail})"


def _deep_rows(deep: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """One line per torch.profiler window: the TensorBoard-plugin breakdown, GPU use, top ops."""
    rows: list[tuple[str, str]] = []
    for doc in deep or []:
        name = os.path.basename(str(doc.get("source", "")))
        if "error" in doc:
            rows.append(("Deep window", f"{name}: {doc['error']}"))
            continue
        bd = doc.get("breakdown_us") or {}
        total = bd.get("Total") or 0
        steps = doc.get("steps") or []
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "whole trace"
        parts = [f"{_TB_LABELS[k]} {v / total * 100:.0f}%" for k, v in bd.items()
                 if k in _TB_LABELS and total and v / total >= 0.005]
        line = f"{span} · {fmt_time(total / 1e6)}/step · " + " · ".join(parts)
        for dev, g in (doc.get("gpu") or {}).items():
            if isinstance(g, dict) and g.get("utilization") is not None:
                line += f" · GPU {dev} util {g['utilization']:.0f}%"
        rows.append(("Deep window", line))
        top = [o for o in doc.get("operators") or [] if not str(o.get("name", "")).startswith(
            ("enumerate(DataLoader)", "Optimizer.", "ProfilerStep"))][:4]
        if top:
            rows.append(("  top ops", " · ".join(
                f"{o['name']} {fmt_time((o.get('host_self_us') or 0) / 1e6)}" for o in top)
                + f"  (self CPU time over the window; trace: {doc.get('source')})"))
    return rows


_SEVERITY_STYLE = {"high": "bold red", "medium": "bold yellow", "low": "bold blue"}


def fmt_evidence_value(value: Any) -> str:
    """A finding's evidence value as every report shows it (the terminal, the TensorBoard
    and W&B exports): floats to 3 significant digits, nested values inline."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        inner = (f"{k}={fmt_evidence_value(v)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(inner) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(fmt_evidence_value(v) for v in value) + "]"
    return str(value)


def _print_finding(console: Console, i: int, f: dict[str, Any]) -> None:
    """One finding: severity and title, gain, evidence, fix text, snippet, verify line."""
    severity = str(f.get("severity"))
    head = Text(f"\n{i}. ")
    head.append(f"[{severity}]", style=_SEVERITY_STYLE.get(severity, "bold"))
    head.append(f" {f.get('title')}", style="bold")
    console.print(head, soft_wrap=False)
    kind = f"{f.get('category')}/{f.get('cause')} · {impact_text(f)}"
    console.print(Padding(Text(kind), (0, 0, 0, 3)), soft_wrap=False)
    evidence = f.get("evidence") or {}
    if evidence:
        ev = "; ".join(f"{k}={fmt_evidence_value(v)}" for k, v in evidence.items())
        console.print(Padding(Text(f"evidence: {ev}", style="dim"), (0, 0, 0, 3)), soft_wrap=False)
    fix = f.get("fix") or {}
    if fix.get("text"):
        # its quotes in backticks (`trainprof run --py train.py`) are never broken
        print_prose(console, f"fix: {fix['text']}", indent=3)
    for line in str(fix.get("snippet") or "").splitlines():
        # Code is printed unwrapped (soft wrap), so it can be copied as it is.
        console.print(Text(f"      {line}", style="green"), soft_wrap=True)
    if f.get("verify"):
        _print_verify(console, f)


def _print_verify(console: Console, f: dict[str, Any]) -> None:
    """The verify line: its prose wrapped, each of its commands whole on a line of its own
    under the prose that leads to it ("verify:" alone when the line starts with one)."""
    label = "verify:"
    for part, is_command in verify_parts(f):
        if is_command:
            if label:
                print_prose(console, label, indent=3, style="cyan")
                label = ""
            print_command(console, part, indent=6, style="bold cyan")
        else:
            print_prose(console, f"{label} {part}" if label else part, indent=3, style="cyan")
            label = ""
