"""``trainprof verify RUN_DIR``: measure a finding's fix on the run's own command.

Every finding ends with a way to prove it, usually a ``trainprof tune --knob ...`` line: the
knob applies the fix to the unmodified script (more workers, channels_last, float32, ...).
``verify`` takes that line from a recorded run's finding, runs the run's own command (its
script or module, its arguments, from the folder it ran in, with the interpreter and the
environment variables it ran with: :mod:`trainprof.experiments.trial_setting`) under
``trainprof tune`` with those knobs, and then sets what was measured against what the
finding estimated:

* ``confirmed``: the fix arm is significantly faster, and its saving is within the
  finding's bound (an upper bound: "could save up to X%");
* ``beyond the bound``: significantly faster by more than the bound's interval allows - the
  estimate was too low, which is worth knowing (and reporting);
* ``not confirmed``: no significant difference: the fix does not matter here, or more
  ``--trials`` are needed (the interval says which);
* ``refuted``: significantly slower: keep the current setting;
* ``did not help``: significantly slower, where the knob is only an aside of the finding
  (its main fix is a code change: :func:`knob_role`): the verdict is the knob's, and the
  finding stands or falls by its main fix, measured as its verify line says;
* ``not applicable``: the knob changed nothing in this script (a DataLoader knob where
  the script makes none);
* ``unsettled``: the fastest arm's trials disagree too much to size the change (one ran
  far slower than the others: outside load), whatever its interval says - rerun with more
  ``--trials`` on a quieter machine (:data:`trainprof.experiments.tune.UNSETTLED_SPREAD`);
  or it or the baseline has one usable trial (``--trials 1``, Ctrl-C after the first
  round), whose interval is within that trial, blind to the noise between trials
  (:data:`trainprof.experiments.tune.MIN_TRIALS`).

The first value of a knob is the baseline: the run's own setting where its record tells it
(a DataLoader's ``num_workers``, the training thread's ``torch_threads``), else as the
finding wrote it (the current setting first: ``channels_last=false,true``). With several
values or knobs, the fastest arm is the one judged. Launch folders (torchrun, srun:
``ranks/`` without a record of their own) are refused: their command is one rank's. A run
that crashed is rerun to the step it crashed after, not past it (:func:`trial_steps`).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path
from typing import Any

from trainprof.errors import UsageError

#: Every verdict :func:`judge` gives, in the module docstring's order, with what it means in
#: a few words (``trainprof verify --help`` lists them from here).
VERDICTS = {
    "confirmed": "significantly faster, within the finding's bound",
    "beyond the bound": "faster than the estimate allowed",
    "not confirmed": "no significant difference",
    "refuted": "significantly slower",
    "did not help": "an aside knob, not the finding's main fix, was significantly slower",
    "not applicable": "the knob changed nothing in this script",
    "unsettled": "the trials disagree too much, or one a side is too few, to size the "
                 "change",
    "no data": "no arm has a usable measurement",
}

#: Steps per trial where neither ``--steps`` nor the verify line says.
DEFAULT_STEPS = 60
#: A run that crashed after fewer complete steps than this is refused: trials that stop
#: before the crash would have too few steady steps to measure anything.
MIN_CRASH_STEPS = 10

#: ``--knob NAME=V1,V2`` and ``--steps N`` in a verify line's tune command.
_KNOB = re.compile(r"--knob\s+([a-z_0-9]+=[A-Za-z0-9_.,\-]+)")
_STEPS = re.compile(r"--steps\s+(\d+)")


def measures_fix(verify: str) -> bool:
    """Whether a verify line's knob applies the finding's fix itself: the line starts with
    its ``trainprof tune``. A line that starts otherwise ("`trainprof run ...` after the
    change") has a fix that is a code change; a knob further on is an aside (a worker for a
    thread) or the bound (``synthetic_data``: the most any input fix can gain)."""
    return verify.lstrip("` ").startswith("trainprof tune")


def knob_role(verify: str) -> str:
    """What the knob verify measures is to the finding, by its verify line
    (:func:`knob_specs` picks it): ``fix`` (the line starts with its ``trainprof tune``: the
    knob applies the fix itself, judged against the estimate), ``bound`` (a fix that is a
    code change, measured by ``synthetic_data``: the most any input fix can give, a ceiling
    to set against the estimate, not a fix to apply) or ``aside`` (a fix that is a code
    change, measured by another knob of its line: a worker for a thread, 16-bit gradients
    beside gradient accumulation; what it says is the knob's, not the finding's). A finding
    whose knob is only part of its fix writes the code change first, as the convention of
    :func:`measures_fix` says."""
    if "trainprof tune" not in verify or measures_fix(verify):
        return "fix"
    specs, _ = knob_specs(verify)
    return "bound" if any(s.startswith("synthetic_data=") for s in specs) else "aside"


def main_measure(verify: str) -> str:
    """How a verify line measures the finding's main fix: its first part, up to the first
    ``;`` (the asides and the bound come after it) - "`trainprof run t.py` after the
    change, then trainprof compare ..." where the fix is a code change."""
    return verify.split(";", 1)[0].strip()


def knob_specs(verify: str) -> tuple[list[str], int | None]:
    """The ``--knob`` specs and ``--steps`` of the ``trainprof tune`` command in a finding's
    verify line that verify measures (``[]`` when it has none): the first, or where the fix
    is a code change (:func:`measures_fix`) the one that measures the finding's bound
    (``synthetic_data``) if there is one. Only tune's own options count: they come before
    the script, and the script's own arguments (its ``--steps 100000``) after."""
    start = verify.find("trainprof tune")
    if start < 0:
        return [], None
    bound = verify.find("trainprof tune --knob synthetic_data")
    if not measures_fix(verify) and bound >= 0:
        start = bound
    command = verify[start + len("trainprof tune"):].split(";", 1)[0]
    words = command.split()
    own: list[str] = []
    i = 0
    while i < len(words) and words[i].startswith("-"):  # tune's options, up to the script
        own += words[i:i + 2]
        i += 2
    options = " ".join(own)
    steps = _STEPS.search(options)
    return _KNOB.findall(options), int(steps.group(1)) if steps else None


def pick_finding(findings: list[dict[str, Any]], number: int | None
                 ) -> tuple[int, dict[str, Any], list[str], int | None]:
    """The finding to verify: ``number`` (1-based, as printed) or the first with a knob."""
    if not findings:
        raise UsageError("the run has no finding to verify")
    if number is not None:
        if not 1 <= number <= len(findings):
            raise UsageError(f"--finding {number}: the run has {len(findings)} "
                             f"finding{'s' if len(findings) != 1 else ''}")
        finding = findings[number - 1]
        specs, steps = knob_specs(str(finding.get("verify") or ""))
        if not specs:
            raise UsageError(f"finding {number} ({finding.get('category')}/"
                             f"{finding.get('cause')}) has no knob to measure; its verify "
                             f"line says: {finding.get('verify')}")
        return number, finding, specs, steps
    for i, finding in enumerate(findings, 1):
        specs, steps = knob_specs(str(finding.get("verify") or ""))
        if specs:
            return i, finding, specs, steps
    raise UsageError("no finding of the run has a knob to measure (see each verify line)")


def current_first(specs: list[str], meta: dict[str, Any]) -> list[str]:
    """Each knob's values with the run's own setting first, where the record tells it (the
    baseline is the first value; a sweep written in order - ``torch_threads=1,2`` - may
    start with a value the run did not have). Otherwise as written: the findings write the
    current setting first (``channels_last=false,true``). A run that left the knob to the
    script (``_actual``: "script's") has the value :data:`SCRIPT_VALUE`: ``autocast=off,script``
    measures from the script's own float16 autocast, not from the knob's bf16."""
    from trainprof.capture.knobs import SCRIPT_VALUE
    from trainprof.experiments.tune import _actual

    out = []
    for spec in specs:
        name, _, values = spec.partition("=")
        texts = values.split(",")
        current = _actual(name, meta).split(" ", 1)[0]  # "4", "true (...)" -> "true"
        if current == "script's":  # the run left it to the script: the knob's "script"
            current = SCRIPT_VALUE
        if current in texts[1:]:
            texts.remove(current)
            texts.insert(0, current)
        out.append(f"{name}={','.join(texts)}")
    return out


def crashed_after(summary: dict[str, Any]) -> int | None:
    """The complete steps a run made before it crashed (its summary's count), None where it
    did not crash."""
    if summary.get("status") != "crashed":
        return None
    return int((summary.get("steps") or {}).get("count") or 0)


def trial_steps(summary: dict[str, Any], asked: int | None, line_steps: int | None
                ) -> tuple[int, str | None]:
    """How many steps each trial runs (``--steps``, else the verify line's, else
    :data:`DEFAULT_STEPS`), and what to say of it up front.

    The trials rerun the run's own command, so a script that raised at its step 50 raises
    there again: trials of 60 steps all crashed, and verify said "no data" having thrown
    their 50 steps away. For a crashed run the trials stop at the steps it completed (the
    stop comes at a step's end, before the next one starts); ``--steps`` as given is kept
    (the script may have been fixed since), with a warning if it goes past the crash. A run
    that crashed after fewer than :data:`MIN_CRASH_STEPS` is refused (UsageError)."""
    steps = asked or line_steps or DEFAULT_STEPS
    done = crashed_after(summary)
    if done is None:
        return steps, None
    if asked is not None:
        return asked, (f"the run crashed after {_steps_text(done)}: trials of --steps {asked} "
                       + ("stop before that" if asked <= done else
                          "go past that point and crash there too unless the script was "
                          "fixed since"))
    if done < MIN_CRASH_STEPS:
        raise UsageError(f"the run crashed after {_steps_text(done)}, too few for trials that "
                         f"stop before the crash (at least {MIN_CRASH_STEPS}): fix the crash, "
                         "run the script again and verify that run")
    steps = min(steps, done)
    return steps, (f"the run crashed after {_steps_text(done)}: its trials run {steps} steps, "
                   "to stop before the crash (--steps to choose)")


def _steps_text(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _main_rank_meta(run_dir: Path) -> dict[str, Any]:
    """The metadata of the record a folder's figures come from (``load_ranks``' main)."""
    from trainprof.analysis.ranks import load_ranks

    main, _ = load_ranks(run_dir)
    return main.meta


def trial_knobs(meta: dict[str, Any], specs: list[str]) -> list[str]:
    """The knobs a run was itself a trial of (a tune or verify trial's folder: its record's
    ``knobs.requested``) that ``specs`` do not set, as one-value specs: every arm keeps
    them, so the fix is measured in the setting the run had (its ``num_workers=4``), not
    the script's own. Values that do not read back as they were are left out."""
    from trainprof.capture.knobs import parse_value

    requested = (meta.get("knobs") or {}).get("requested") or {}
    named = {spec.partition("=")[0] for spec in specs}
    out = []
    for name, value in requested.items():
        if name in named or value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        try:
            if parse_value(name, text) != value:
                continue
        except UsageError:
            continue
        out.append(f"{name}={text}")
    return out


def original_command(meta: dict[str, Any]) -> tuple[str, list[str], bool, Path | None]:
    """The run's target, its arguments, whether it is a module, and the folder it started
    in."""
    command = meta.get("command")
    if not isinstance(command, list) or len(command) < 2:
        raise UsageError("the run's record has no command line to run again")
    rest = [str(c) for c in command[1:]]  # (the first is the interpreter)
    module = rest[0] == "-m"
    if module and len(rest) < 2:
        raise UsageError("the run's record has no module to run again")
    target, args = (rest[1], rest[2:]) if module else (rest[0], rest[1:])
    # where the command started (a script may chdir before its first step, where the
    # fingerprint reads it): older records have the fingerprint's only
    cwd = ((meta.get("launch") or {}).get("cwd")
           or (meta.get("fingerprint") or {}).get("cwd"))
    return target, args, module, Path(cwd) if cwd else None


def judge(finding: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """What the tune result says of the finding's estimate (module docstring)."""
    arms = [a for a in doc.get("arms") or [] if not a.get("baseline")]
    measured = [a for a in arms if a.get("ratio") is not None]
    bound = float(finding.get("estimated_gain") or 0.0)
    unknown = bool((finding.get("evidence") or {}).get("gain_unknown"))
    verify = str(finding.get("verify") or "")
    role = knob_role(verify)
    # a knob beside a fix that is a code change: the estimate is not this knob's to meet
    aside = role == "aside"
    out: dict[str, Any] = {"estimated_gain": bound, "gain_unknown": unknown or aside,
                           "aside": aside, "role": role}
    if role != "fix":  # the knob is not the fix: the verdict names how to measure that
        out["main_fix"] = main_measure(verify)
    if not measured:
        return {**out, "verdict": "no data", "arm": None}
    best = min(measured, key=lambda a: a["ratio"])
    ratio, (lo, hi) = best["ratio"], best.get("ci") or (None, None)
    saving = 1.0 - ratio
    base = next((a for a in doc.get("arms") or [] if a.get("baseline")), {})
    out.update(arm=best["name"], ratio=ratio, ci=[lo, hi], saving=saving,
               saving_ci=[None if hi is None else 1.0 - hi, None if lo is None else 1.0 - lo],
               # what the runs with the fix found next (tune's top finding of that arm)
               next_finding=best.get("top_finding"),
               # how near the machine's matmul peak the steps ran, without and with the fix
               flops_utilization=[base.get("flops_utilization"),
                                  best.get("flops_utilization")],
               # the trials of the baseline and that arm that shared their machine
               outside_load=[a["outside_load"] for a in (base, best)
                             if isinstance(a.get("outside_load"), dict)] or None)
    if best.get("verdict") == "faster":
        least = out["saving_ci"][0]  # the interval must clear the bound, not the estimate
        beyond = (not unknown and not aside and bound > 0 and least is not None
                  and least > bound)
        verdict = "beyond the bound" if beyond else "confirmed"
    elif best.get("verdict") == "slower":  # even the fastest arm: all of them are
        # an aside's cost refutes the aside, not the finding (DDP's 16-bit gradients
        # between ranks of one host, beside gradient accumulation: "refuted" dropped a
        # sound diagnosis)
        verdict = "did not help" if aside else "refuted"
    elif best.get("verdict") == "no_effect":  # the knob did not apply: nothing measured
        verdict = "not applicable"
    elif best.get("verdict") == "unsettled":  # its rounds disagree, or one trial: no size
        verdict = "unsettled"
        out["round_ratios"] = best.get("round_ratios")
        out["unsettled_by"] = best.get("unsettled_by")
    else:
        verdict = "not confirmed"
    return {**out, "verdict": verdict}


def verify_command(run_dir: Path, *, finding: int | None, steps: int | None, trials: int,
                   out: Path | None, json_out: bool) -> int:
    """``trainprof verify``: pick the finding, tune its knobs on the run's command, judge.

    Returns tune's exit code (0; 130 when stopped; 1 when the baseline had no usable trial).
    """
    from trainprof.commands import analyse_folder
    from trainprof.experiments.trial_setting import run_setting
    from trainprof.experiments.tune import tune_command
    from trainprof.store import RANKS_DIR, RUN_JSON, VERIFY_JSON, default_run_dir, load_run

    run_dir = Path(run_dir)
    if not (run_dir / RUN_JSON).is_file() and (run_dir / RANKS_DIR).is_dir():
        raise UsageError(f"{run_dir} is a launch of several ranks: verify runs one "
                         "process; run the finding's tune line under your launcher")
    run = load_run(run_dir)  # its words for a folder that is missing or holds no run, as report's
    summary, _ = analyse_folder(run_dir)
    number, chosen, specs, verify_steps = pick_finding(summary.get("findings") or [], finding)
    steps, crash_note = trial_steps(summary, steps, verify_steps)
    # the settings the finding read: the main rank's where the script spawned its ranks
    # (the launching process kept its own: 2 threads where each rank set 1); the command
    # stays the launching process's, the one the user ran
    settings = _main_rank_meta(run_dir) if (run_dir / RANKS_DIR).is_dir() else run.meta
    specs = current_first(specs, settings) + trial_knobs(settings, specs)
    target, args, module, cwd = original_command(run.meta)
    tune_dir = (out if out is not None else default_run_dir(
        f"verify-{Path(target).stem if not module else target.rsplit('.', 1)[-1]}")).resolve()
    head = {"run_dir": str(run_dir), "finding_number": number,
            "finding": {k: chosen.get(k) for k in ("category", "cause", "title", "severity",
                                                   "estimated_gain", "verify")},
            "knobs": specs, "cwd": str(cwd) if cwd else None, "steps": steps,
            "crashed_after": crashed_after(summary)}
    if not json_out:
        print(f"trainprof verify: finding {number} of {run_dir}: {chosen.get('title')}\n"
              f"  measuring {' '.join('--knob ' + s for s in specs)} on "
              f"{' '.join([('-m ' if module else '') + target, *args])}"
              + (f" (in {cwd})" if cwd else ""), flush=True)
    if crash_note:  # before any trial: why they are shorter, or why they may crash
        print(f"  {crash_note}", file=sys.stderr if json_out else sys.stdout, flush=True)
    here = Path.cwd()
    captured = io.StringIO()
    try:
        if cwd is not None:
            try:
                os.chdir(cwd)
            except OSError as exc:
                raise UsageError(f"cannot enter the folder the run ran in, {cwd}: "
                                 f"{exc.strerror}") from None
        setting = run_setting(run.meta, target, module, cwd)
        head["setting"] = setting.to_json()
        line = setting.line()
        if line:
            print(f"  {line}", file=sys.stderr if json_out else sys.stdout, flush=True)
        with contextlib.redirect_stdout(captured) if json_out else contextlib.nullcontext():
            code = tune_command(target, args, module=module, knobs=specs,
                                steps=steps, trials=trials,
                                json_out=False, out=tune_dir, baseline=None, setting=setting)
    except UsageError:
        if out is None:  # refused before any trial (the script is gone): no empty folder left
            with contextlib.suppress(OSError):
                tune_dir.rmdir()
        raise
    finally:
        os.chdir(here)
    import orjson

    doc = orjson.loads((tune_dir / "tune.json").read_bytes())
    result = {**head, "tune_dir": str(tune_dir), "status": doc.get("status"),
              "metric": doc.get("metric"), **judge(chosen, doc)}
    with contextlib.suppress(OSError):
        (tune_dir / VERIFY_JSON).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    if json_out:
        from trainprof.report.json_report import render_json

        render_json(result)
    else:
        from trainprof.report.verify_terminal import render_verdict

        render_verdict(result)
    return code
