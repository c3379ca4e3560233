"""Which lines of the training loop its "other" time goes to, from the sampled stacks.

Reads ``RUN_DIR/stacks.jsonl`` (:mod:`trainprof.capture.loop_stacks`: the training
thread's stack a few times a second, with the step and phase of the moment) and
answers what the step breakdown cannot: of the time outside the DataLoader, the
model, backward and the optimizer, which line of the loop is it spent on, and
inside it, which line of the user's code and which library function.

Definitions:

* Samples count when they fall in a *steady* step (the summary's: complete steps
  after the warm-up) whose "other" time is not an outlier - above its median by
  more than 5 robust standard deviations (1.4826 x MAD), half a median step and
  0.5 ms (:func:`trainprof.analysis.steps.outliers`, the diagnosis' spikes:
  Composer's median/MAD pruning). Work that happens every N steps (evaluation,
  checkpoints) belongs to the periodic-overhead finding, which measures it from the
  step records; here it would only blur what every step does. Where an iteration is
  k >= 2 steps of different kinds (a GAN's critic stepped k times a generator step:
  the summary's ``steps.per_iteration``, :mod:`trainprof.analysis.iterations`), a
  step is judged among the steps of its own place in the iteration (step number mod
  k), as the diagnosis judges spikes (:attr:`trainprof.diagnosis.context.RunContext.
  step_kinds`): against all steps the generator's step, long once an iteration by
  design, is an outlier, and the lines of its "other" time were never counted.
* The *loop function* is the deepest function on the stack of at least
  :data:`LOOP_PRESENCE` of the counted samples in "other" and as many of those in
  the other phases: the function whose loop calls the model and the optimizer (a
  script's ``<module>``, ``train()``, a Trainer's ``fit`` when it is the user's
  code). Library functions count too, so that when the loop is a framework's - the
  script calls ``Trainer(...).train()`` (Hugging Face) or ``trainer.fit(model)``
  (PyTorch Lightning) and every sample is under that one line - the lines named are
  the framework loop's (``_inner_training_loop``'s), not the script's single call
  into it. ``loop["library"]`` says which, ``called_from`` is then the user's
  line the framework was called from, and ``other["user_lines"]`` the rows of the
  user's own code inside that loop (by the innermost user frame of each sample: a
  callback, a hook, ``training_step``'s own lines), for what the user can change.
* A sample's *loop line* is the line the loop function was on; its *inner line*
  is the innermost user frame below it (the user's own hook or callback inside a
  framework's loop); its *library call* is the innermost frame when that frame is
  not the user's (``numpy``'s, ``torch.save``'s).
* A loop line's ``phase_samples`` are the ticks in the phases (the model, backward,
  the optimizer, the data) on that same line: ``loss = F.cross_entropy(model(x), y)``
  has both, its "other" part being the functional loss; a line that makes batches or
  logs has none. Ticks in "other" inside ``torch.optim`` count there too: the step
  wrapper torch puts around ``optimizer.step()`` runs before the pre-hooks that start
  the optimizer phase, so ``opt.step()`` has "other" ticks that are the optimizer's.
* Counts are timer ticks (a sample taken after several ticks, at the end of one
  long C call, weighs that many), so shares are shares of time. ``share`` is a
  fraction of the "other" ticks; with ``n`` of them, its standard error is
  ``sqrt(share (1 - share) / n)`` (a binomial proportion).
* A run of at most :data:`FIRST_STEPS_ONLY` complete steps has no steady state (its
  steps are the first, with every one-time cost in them: the noise rule says so), and
  none of its samples is counted above. Its samples, and those of the warm-up steps of
  a longer run, go to ``first_steps``: where that time went, whatever the phase, by the
  innermost line of the user's code on the stack (the line that was running, or that
  made the call - a ``time.sleep``, a matmul - the thread was in), with the user's
  line that called its function (``called_from``). A first step is sampled only from
  ``LONG_STEP_S`` (1 s) into it on (:mod:`trainprof.capture.loop_stacks`), so
  ``seconds`` (the ticks times ``tick_s``) says how much of the steps' time the
  samples cover.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from trainprof.analysis.ops import source_line
from trainprof.analysis.steps import SPIKE_ABS_S, SPIKE_REL, complete_steps, outliers_by_kind
from trainprof.schema import OTHER, PHASE_NAMES
from trainprof.store import STACKS_JSONL

#: A user function on the stack of this share of the samples encloses the training loop.
LOOP_PRESENCE = 0.9
#: Loop lines reported.
TOP_LINES = 8
#: Runs of at most this many complete steps have no steady state (the noise rule's
#: too_few_steps finding says so): their samples are the first steps'.
FIRST_STEPS_ONLY = 2

Frame = tuple[str, int, str, bool]  # file, line, function, the user's own code


Sample = tuple[int, int, int, int, bool]  # step, phase, stack, weight (ticks), in a sync


Sources = dict[tuple[str, int], str]  # (file, line) -> the line's text, as recorded


def _read(
    path: Path,
) -> tuple[dict[int, list[Frame]], list[Sample], int, Sources, float | None] | None:
    """(stacks by id, samples as (step, phase, stack, weight, in_sync), ticks not kept,
    the recorded source of user lines, the seconds a weight of 1 stands for), or None.
    Records written before the in-sync flag have four elements (not in a sync); before
    the sources, none are recorded; before ``tick_s``, the tick's time is unknown."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError:
        return None
    stacks: dict[int, list[Frame]] = {}
    samples: list[Sample] = []
    sources: Sources = {}
    dropped = 0
    tick_s: float | None = None
    with f:
        for raw in f:
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError:
                break  # a torn last line from a crash
            if not isinstance(doc, dict):
                continue
            if "samples" in doc:
                samples.extend((int(x[0]), int(x[1]), int(x[2]), int(x[3]) if len(x) > 3 else 1,
                                len(x) > 4 and bool(x[4])) for x in doc["samples"])
            elif "stack" in doc:
                frames = [(str(fr[0]), int(fr[1]), str(fr[2]), bool(fr[3]))
                          for fr in doc["frames"]]
                stacks[int(doc["stack"])] = frames
                for fr, text in zip(frames, doc.get("sources") or (), strict=False):
                    if text:
                        sources[(fr[0], fr[1])] = str(text)
            elif "dropped" in doc:
                dropped += int(doc["dropped"])
            elif isinstance(doc.get("tick_s"), int | float) and doc["tick_s"] > 0:
                tick_s = float(doc["tick_s"])
    return stacks, samples, dropped, sources, tick_s


def _step_kinds(steady: np.ndarray, per_iteration: int | None) -> np.ndarray | None:
    """Each steady step's place in its iteration (step number mod ``per_iteration``), or
    None where an iteration is one step or there are too few steps of each kind (under
    5 an iteration's step: :func:`~trainprof.analysis.steps.outliers` judges none). The
    diagnosis' rule (``RunContext.step_kinds``), so that the steps these lines leave out
    are the steps it calls spikes. Step numbers, not positions: steps left out under a
    heavy tool do not shift the kinds of the steps after them."""
    k = per_iteration
    if not k or k < 2 or len(steady) < 5 * k:
        return None
    numbers = steady["step"].astype(np.int64)
    if np.any(np.diff(numbers) <= 0):  # not numbered in order: positions
        numbers = np.arange(len(steady))
    return (numbers - numbers[0]) % k


def _typical_steps(steps: np.ndarray, warmup: int,
                   per_iteration: int | None = None) -> tuple[set[int], int]:
    """Step numbers of steady steps whose "other" time is not an outlier (among the steps
    of their kind, where an iteration is several: :func:`_step_kinds`), and how many
    are."""
    done = complete_steps(steps)
    steady = done[min(warmup, len(done)):]
    if len(steady) == 0 or len(done) <= FIRST_STEPS_ONLY:
        return set(), 0
    step_med = float(np.median(steady["dur_ns"])) / 1e9
    out = outliers_by_kind(steady["other_ns"].astype(np.float64) / 1e9,
                           max(SPIKE_REL * step_med, SPIKE_ABS_S),
                           _step_kinds(steady, per_iteration))
    keep = np.ones(len(steady), dtype=bool)
    keep[out] = False
    return {int(s) for s in steady["step"][keep]}, len(out)


Kept = list[tuple[int, list[Frame], int, bool]]  # phase, frames, weight, in a sync


def _loop_function(kept: Kept) -> tuple[str, str, bool] | None:
    """(file, function, the user's own) of the deepest function on LOOP_PRESENCE of the
    samples of each kind: "other" and the phases (the model, backward, the optimizer, the
    data).

    Both kinds: when one line takes nearly all of a step, nearly every sample is
    inside it, and only the samples in the phases show that the loop is further out.
    Depth is counted in the user's frames first, then in all frames: a library function
    wins only below the deepest such user function (a framework's loop the script calls
    into), never above it (``runpy``, trainprof's launcher, a ``@torch.no_grad()``
    wrapper around the user's ``train()``).
    """
    totals = [0, 0]
    seen: list[Counter[tuple[str, str]]] = [Counter(), Counter()]
    depth: dict[tuple[str, str], tuple[int, int]] = {}
    mine: dict[tuple[str, str], bool] = {}
    for phase, frames, weight, _in_sync in kept:
        g = int(phase == OTHER)
        totals[g] += weight
        here = set()
        users = 0
        for i, (file, _line, func, user) in enumerate(frames):
            users += user
            key = (file, func)
            if key not in here:
                here.add(key)
                depth[key] = max(depth.get(key, (0, 0)), (users, i))
                mine[key] = user
        for key in here:
            seen[g][key] += weight
    candidates = [k for k in depth
                  if all(seen[g][k] >= LOOP_PRESENCE * totals[g] for g in (0, 1))]
    if not candidates or not any(mine[k] for k in candidates):
        return None  # no user function encloses the loop: lines are named by user frames
    best = max(candidates, key=lambda k: depth[k])
    return best[0], best[1], mine[best]


def summarize_loop_stacks(
    run_dir: Path, steps: np.ndarray, warmup: int, other_share: float | None = None,
    per_iteration: int | None = None,
) -> dict[str, Any] | None:
    """The ``loop_stacks`` section of a run summary, or None when the run has no samples.

    Counts are in timer ticks (a sample's weight), so a share is a share of time.
    ``other_share`` is the measured share of "other" in steady step time (the summary's
    ``breakdown_detail``): a line's ``step_share`` is its share of "other" times that.
    ``per_iteration``: the summary's ``steps.per_iteration`` (steps of k kinds, each
    judged among its own kind for outliers).
    """
    read = _read(Path(run_dir) / STACKS_JSONL)
    if read is None:
        return None
    stacks, samples, dropped, sources, tick_s = read
    typical, spike_steps = _typical_steps(steps, warmup, per_iteration)
    kept: Kept = [(phase, stacks[sid], w, in_sync) for step, phase, sid, w, in_sync in samples
                  if step in typical and sid in stacks]
    phases: Counter[str] = Counter()
    in_syncs = 0
    for phase, _frames, w, in_sync in kept:
        phases[PHASE_NAMES[phase] if 0 <= phase < len(PHASE_NAMES) else "?"] += w
        if in_sync and phase == OTHER:
            in_syncs += w
    out: dict[str, Any] = {
        "samples": sum(x[3] for x in samples),
        "counted": sum(phases.values()),
        "not_kept": dropped,
        "outlier_steps": spike_steps,
        "by_phase": dict(phases),
        "loop": None,
        # "other" samples taken inside a device sync (a CUDA tensor's .item()) are the
        # sync finding's time, measured by the clock: the lines below are asked of the
        # rest (on an H100, 81% of a loop's "other" samples were on its `loss.item()`
        # line, the host waiting for the GPU, and were read as the loop's own code)
        "other": {"samples": phases.get("other", 0) - in_syncs, "in_syncs": in_syncs,
                  "lines": []},
        "first_steps": _first_steps(steps, warmup, stacks, samples, sources, tick_s),
    }
    if not kept:
        return out
    found = _loop_function(kept)
    loop = None if found is None else found[:2]
    callers: Counter[tuple[str, int]] = Counter()
    if found is not None:
        out["loop"] = {"file": found[0], "function": found[1]}
        if not found[2]:
            out["loop"]["library"] = True
    framework = found is not None and not found[2]
    lines: Counter[tuple[str, int] | None] = Counter()
    inner: dict[tuple[str, int] | None, Counter[tuple[str, int, str]]] = {}
    calls: dict[tuple[str, int] | None, Counter[str]] = {}
    in_phases: Counter[tuple[str, int] | None] = Counter()
    # a framework's loop: the user's own lines inside it (hooks, callbacks, training_step)
    user_lines: Counter[tuple[str, int] | None] = Counter()
    user_calls: dict[tuple[str, int] | None, Counter[str]] = {}
    user_in_phases: Counter[tuple[str, int] | None] = Counter()
    for phase, frames, w, in_sync in kept:
        if in_sync and phase == OTHER:
            continue
        at_loop = None if loop is None else next(
            (i for i, fr in enumerate(frames) if (fr[0], fr[2]) == loop), None)
        innermost = None
        if framework and at_loop is not None:
            mine_below = [fr for fr in frames[at_loop + 1:] if fr[3]]
            innermost = mine_below[-1][:2] if mine_below else None
        if phase != OTHER:
            if at_loop is not None:
                in_phases[frames[at_loop][:2]] += w
                if innermost is not None:
                    user_in_phases[innermost] += w
            continue
        if at_loop is not None and _in_optimizer_call(frames[at_loop + 1:]):
            # torch's wrapper around an optimizer's step(), before its pre-hooks start the
            # optimizer phase and after its post-hooks end it: the optimizer's own call
            in_phases[frames[at_loop][:2]] += w
            if innermost is not None:
                user_in_phases[innermost] += w
        if framework and at_loop is not None:
            user_lines[innermost] += w
            if frames and not frames[-1][3]:
                user_calls.setdefault(innermost, Counter())[_call_name(frames[-1])] += w
        mine = [fr for fr in frames if fr[3]]
        at, below = None, mine
        if loop is None:
            if mine:
                at, below = (mine[0][0], mine[0][1]), mine[1:]
        elif at_loop is not None:  # the outermost loop frame; the user's frames below it
            at, below = frames[at_loop][:2], [fr for fr in frames[at_loop + 1:] if fr[3]]
            caller = [fr for fr in frames[:at_loop] if fr[3]]
            if caller and found is not None and not found[2]:
                callers[caller[-1][:2]] += w
        lines[at] += w
        if below:
            inner.setdefault(at, Counter())[below[-1][:3]] += w
        leaf = frames[-1] if frames else None
        if leaf is not None and not leaf[3]:
            calls.setdefault(at, Counter())[_call_name(leaf)] += w
    n_other = sum(lines.values())
    rows = _line_rows(lines, n_other, in_syncs, other_share, in_phases, calls, sources, inner)
    out["other"]["lines"] = rows
    if framework:
        out["other"]["user_lines"] = _line_rows(user_lines, n_other, in_syncs, other_share,
                                                user_in_phases, user_calls, sources)
    if callers:
        (file, line), _n = callers.most_common(1)[0]
        out["loop"]["called_from"] = {"file": file, "line": line,
                                      "source": _code_line(file, line, sources)}
    return out


def _first_steps(
    steps: np.ndarray, warmup: int, stacks: dict[int, list[Frame]], samples: list[Sample],
    sources: Sources, tick_s: float | None,
) -> dict[str, Any] | None:
    """Where the time of the steps before the steady ones went (all the steps of a run
    without a steady state), by the innermost line of the user's code on each sample's
    stack; None when they have no sample (see the module docstring)."""
    done = complete_steps(steps)
    steady_state = len(done) > FIRST_STEPS_ONLY and len(done) > warmup
    first_steady = int(done["step"][warmup]) if steady_state else None
    mine = [(phase, stacks[sid], w) for step, phase, sid, w, _sync in samples
            if sid in stacks and (first_steady is None or step < first_steady)]
    total = sum(w for _p, _f, w in mine)
    if total <= 0:
        return None
    # every step, the partial last one too, where the run has no steady state
    span = steps if first_steady is None else steps[steps["step"] < first_steady]
    step_s = float(span["dur_ns"].sum()) / 1e9 if len(span) else None
    lines: Counter[tuple[str, int] | None] = Counter()
    funcs: dict[tuple[str, int] | None, str] = {}
    by_phase: dict[tuple[str, int] | None, Counter[str]] = {}
    outer: dict[tuple[str, int] | None, Counter[tuple[str, int]]] = {}
    calls: dict[tuple[str, int] | None, Counter[str]] = {}
    phases: Counter[str] = Counter()
    for phase, frames, w in mine:
        name = PHASE_NAMES[phase] if 0 <= phase < len(PHASE_NAMES) else "?"
        phases[name] += w
        users = [fr for fr in frames if fr[3]]
        at = users[-1][:2] if users else None
        lines[at] += w
        if users:
            funcs[at] = users[-1][2]
            if len(users) > 1:  # the user's line that called the function it was in
                outer.setdefault(at, Counter())[users[-2][:2]] += w
        by_phase.setdefault(at, Counter())[name] += w
        if frames and not frames[-1][3]:
            calls.setdefault(at, Counter())[_call_name(frames[-1])] += w
    rows = []
    for at, count in lines.most_common(TOP_LINES):
        row: dict[str, Any] = {
            "file": at[0] if at else None,
            "line": at[1] if at else None,
            "function": funcs.get(at),
            "source": _code_line(*at, sources) if at else None,
            "samples": count,
            "share": count / total,
            "by_phase": dict(by_phase[at].most_common()),
            "called_from": None,
            "library_call": None,
        }
        if at in outer:
            (file, line), _n = outer[at].most_common(1)[0]
            row["called_from"] = {"file": file, "line": line,
                                  "source": _code_line(file, line, sources)}
        if at in calls:
            name, n_call = calls[at].most_common(1)[0]
            row["library_call"] = {"name": name, "samples": n_call, "share": n_call / total}
        rows.append(row)
    return {
        "steps": len(span),
        # False: the run has no steady state, these are all its steps
        "steady_state": steady_state,
        "step_s": step_s,
        "samples": total,
        # the time the samples stand for: a first step is sampled from 1 s into it on
        "seconds": total * tick_s if tick_s is not None else None,
        "by_phase": dict(phases.most_common()),
        "lines": rows,
    }


def _in_optimizer_call(frames: list[Frame]) -> bool:
    """Whether these frames (those below a loop line) are inside ``torch.optim``: the step
    wrapper torch puts around every optimizer's ``step()`` (its ``record_function``, its
    Dynamo guard) runs its hooks, and so the clock's optimizer phase, inside it. On a small
    model that is a third of the call (30 of 66 us, SGD on 5k parameters)."""
    return any("/torch/optim/" in fr[0].replace("\\", "/") for fr in frames)


def _line_rows(
    lines: Counter[tuple[str, int] | None],
    n_other: int,
    in_syncs: int,
    other_share: float | None,
    in_phases: Counter[tuple[str, int] | None],
    calls: dict[tuple[str, int] | None, Counter[str]],
    sources: Sources,
    inner: dict[tuple[str, int] | None, Counter[tuple[str, int, str]]] | None = None,
) -> list[dict[str, Any]]:
    """The top lines "other" ticks went to, each with its shares, the ticks in the phases on
    it, the innermost user line below it and the library function most of its ticks were in.
    ``None`` (the first user frame, or the user's frame inside a framework's loop, missing)
    is a row with no file."""
    rows = []
    for at, count in lines.most_common(TOP_LINES):
        row: dict[str, Any] = {
            "file": at[0] if at else None,
            "line": at[1] if at else None,
            "source": _code_line(*at, sources) if at else None,
            "samples": count,
            "share": count / n_other,
            # of all "other" ticks, those in syncs included: ticks are time
            "step_share": (None if other_share is None
                           else count / (n_other + in_syncs) * other_share),
            # ticks in the model's phases on this line (model(x) and a functional loss
            # on one line): the line is part of the step's own work
            "phase_samples": in_phases.get(at, 0),
            "inner": None,
            "library_call": None,
        }
        if inner is not None and at in inner:
            (file, line, func), n_in = inner[at].most_common(1)[0]
            row["inner"] = {"file": file, "line": line, "function": func,
                            "source": _code_line(file, line, sources), "samples": n_in,
                            "share": n_in / n_other}
        if at in calls:
            name, n_call = calls[at].most_common(1)[0]
            row["library_call"] = {"name": name, "samples": n_call, "share": n_call / n_other}
        rows.append(row)
    return rows


def _code_line(file: str, line: int, sources: Sources | None = None) -> str | None:
    """The source line without its trailing comment (it is quoted in titles and texts):
    as recorded while the script ran, else read from the file now."""
    text = (sources or {}).get((file, line)) or source_line(file, line)
    if not text or "#" not in text:
        return text
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                return text[: tok.start[1]].rstrip() or text
    except (tokenize.TokenError, SyntaxError):  # part of a longer statement: as it is
        pass
    return text


def _call_name(frame: Frame) -> str:
    """``package.module.function`` of a library frame, from its file path."""
    file, _line, func, _u = frame
    parts = Path(file).with_suffix("").parts
    if "trainprof" in parts[:-1]:
        # trainprof's own hook (a CUDA event it records at a phase boundary), wherever it
        # is installed: named as such, not by its module's file name alone
        i = len(parts) - 2 - parts[-2::-1].index("trainprof")
        return ".".join([*parts[i:], func])
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("site-packages", "dist-packages") or re.fullmatch(
            r"python\d+(\.\d+)?", parts[i]
        ):
            parts = parts[i + 1:]  # the import path below site-packages or the stdlib
            break
    else:
        parts = parts[-1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([*parts, func])
