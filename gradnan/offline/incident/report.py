"""The report as people and scripts read it: ``format_text`` (one screen for a small job, a line per role
for a large one) and ``build_report`` (the ``gradnan.report`` JSON document). Both only render the
``Report`` that ``gradnan.offline.analysis.analyze`` decided; nothing here weighs evidence.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...formats.health import health_line
from ...formats.incident import (
    Action,
    Conclusion,
    OriginBasis,
    RecordKind,
    RunUpFinding,
    failing_step_headline,
)
from ...formats.layout import AXES, host_device, rank_label, rank_ranges, step_label, vocabulary_token
from ...formats.schema import nonfinite_counts
from ...formats.text import magnitude, printable_lines, shell_word, untrusted, wrap
from ...formats.wording import describe_largest, growth_path, micro_batch_words, samples_wording
from .analysis import analyze
from .evidence import token_of
from .frames_view import summary_lines
from .gradients import module_of
from .module_table import ROLE_TEXT, module_table, rank_role
from .read import RunFiles
from .runs import SERIOUS_SKIPS
from .runup import RunUp
from .verdict import Incident, Report, RerunFinding


def build_report(files: RunFiles, serious_skips: int = SERIOUS_SKIPS,
                 run: Optional[str] = None) -> Dict[str, Any]:
    """The ``gradnan.report`` document of one launch (``analyze``'s arguments)."""
    return analyze(files, serious_skips, run).to_json()


def _rank_label(view: Optional[Dict[str, Any]]) -> str:
    return rank_label(view or {}, "after", [axis for axis in AXES if axis in (view or {})])


MAX_ORIGIN_LINES = 6  # and receivers or silent ranks listed one a line; more are summarised
MAX_LISTED = 3  # bundles, self-tests, problems: the first ones, then a count
WIDTH = 110
MAX_PROBLEM = 400  # characters of a file's problem shown (its path and what was wrong)
def _grouped_lines(views: Sequence[Dict[str, Any]], origin: Sequence[Dict[str, Any]]) -> List[str]:
    """One line per role (and whether the rank's own gradients hold the NaN): how many, which ranks."""
    groups: Dict[Tuple[str, bool], List[int]] = {}
    for view in views:
        key = (rank_role(view, origin), bool(view.get("holds_nonfinite")))
        groups.setdefault(key, []).append(view["global_rank"])
    lines = []
    for role in ROLE_TEXT:
        for holds in (True, False):
            ranks = groups.get((role, holds))
            if ranks:
                state = ", holding the NaN/Inf" if holds else ""
                lines.append(f"  {len(ranks)} {ROLE_TEXT[role]}{state}: {rank_ranges(ranks)}")
    return lines


def _ranks_section(title: str, views: Sequence[Dict[str, Any]],
                   origin: Sequence[Dict[str, Any]]) -> List[str]:
    """A line per rank in a small job; in a large one, a line per role (``_grouped_lines``)."""
    if not views:
        return []
    if len(views) <= MAX_ORIGIN_LINES:
        return [f"{title}:"] + [f"  {_rank_label(view)}"
                                + ("" if view.get("holds_nonfinite", True) else "  (own gradients finite)")
                                for view in views]
    return [f"{title}: {len(views)} rank(s)"] + _grouped_lines(views, origin)


def _listed(items: List[Any], describe, what: str) -> List[str]:
    """The first ``MAX_LISTED`` items' lines, then how many more."""
    lines = [line for item in items[:MAX_LISTED] for line in describe(item)]
    if len(items) > MAX_LISTED:
        lines.append(f"  ... and {len(items) - MAX_LISTED} more {what} (see --json)")
    return lines


def _selftest_lines(result: Dict[str, Any]) -> List[str]:
    failing = result["failing_ranks"]
    state = "PASS" if result["pass"] else "FAIL: " + "; ".join(
        f"rank {e['rank']} ({host_device(e)})" for e in failing[:MAX_LISTED]) + (
        f" ... ({result['failing_total']} ranks failed)" if result["failing_total"] > MAX_LISTED else "")
    return [f"Self-test {untrusted(result['time'])}: {state}"]


def _megatron_line(rerun: RerunFinding) -> List[str]:
    """Megatron's own conclusion, per rank where its ranks' state machines disagree."""
    if rerun.megatron_split:
        split = "; ".join(f"{untrusted(group.conclusion)} on rank(s) {rank_ranges(group.ranks)}"
                          for group in rerun.megatron_split)
        return [f"  Megatron's own rerun of it (validate_results): split: {split}"]
    if not rerun.megatron:
        return []
    return [f"  Megatron's own rerun of it (validate_results): {untrusted(rerun.megatron)}"]


def held_weight(incident: Incident) -> Optional[str]:
    """The origin's bad weight inside the rerun's forward origin, where the origin line names the weight and
    the forward origin a module above it (the first module whose output the rerun saw non-finite)."""
    rerun = incident.rerun
    if rerun is None or rerun.module is None:
        return None
    return next((p["name"] for entry in incident.origin if entry.get("kind") == RecordKind.STATE
                 for p in entry["params"] if module_of(p["name"]).startswith(rerun.module + ".")), None)


def rerun_lines(rerun: Optional[RerunFinding], shown: Sequence[Action] = (),
                held: Optional[str] = None) -> List[str]:
    """The headline of the in-place rerun: the forward origin, its micro-batch, the conclusion (the
    strongest; every other replica's below it). ``shown``: next steps already printing the bundle's replay
    or the micro-batch, not repeated here; ``held``: the origin's weight inside the forward origin
    (``held_weight``)."""
    if rerun is None:
        return []
    when = step_label(rerun.step, rerun.iteration)
    conclusion = rerun.conclusion.headline
    grew_in = rerun.grew_in
    if rerun.module is None:
        replicas = ", ".join(f"dp{dp}" for dp in rerun.concluded_replicas)
        where = (f", on data-parallel replica(s) {replicas} (each its whole model-parallel group; recorded by"
                 f" rank(s) {rank_ranges(rerun.concluded_by)})" if replicas
                 else f" (the rerun records of rank(s) {rank_ranges(rerun.concluded_by)})")
        lines = wrap(f"Rerun of {when} in place: {conclusion}{where}", WIDTH, subsequent_indent="    ")
        if grew_in:
            lines.append(f"  {growth_path(grew_in, None, None)}, on rank {grew_in['global_rank']}")
    else:
        origin = (growth_path(grew_in, rerun.module, rerun.module_class) if grew_in
                  else f"{untrusted(rerun.module)} ({untrusted(rerun.module_class)})")
        lines = [f"Forward origin ({when} run again in place): {origin}",
                 f"  on {_rank_label(rerun.rank)}, {micro_batch_words(rerun.micro_batch)}: {conclusion}"]
        if held is not None:
            lines += wrap(f"the first module whose output the rerun saw non-finite; the origin weight"
                          f" {untrusted(held)} is inside it"
                          + (" (a linear layer built with skip_bias_add returns its bias for the parent to"
                             " add)" if held.endswith(".bias") else ""),
                          WIDTH, initial_indent="  ", subsequent_indent="    ")
        if grew_in and grew_in["global_rank"] != rerun.global_rank:
            lines.append(f"  the value grew on rank {grew_in['global_rank']},"
                         f" {micro_batch_words(grew_in['micro_batch'])}")
    lines += [f"  rank(s) {rank_ranges(group.ranks)}: {Conclusion(group.conclusion).headline}"
              for group in rerun.conclusions[1:]]
    lines += _megatron_line(rerun)
    ties = rerun.origins[1:]
    if ties:
        same = all(o["module"] == rerun.module for o in ties)
        lines.append(f"  the same on rank(s) {rank_ranges([o['global_rank'] for o in ties])} (a tie: each"
                     " went non-finite there first)" if same else "  tied with: " + ", ".join(
                         f"{untrusted(o['module'])} on rank {o['global_rank']}" for o in ties[:MAX_LISTED]))
    if rerun.receivers:
        lines.append(f"  received it{' from there' if rerun.module else ''} (not origins): rank(s) "
                     f"{rank_ranges([r['global_rank'] for r in rerun.receivers])}")
    if rerun.bundle and Action.REPLAY not in shown:
        lines.append(f"  replay it: gradnan replay {shell_word(rerun.bundle)}")
    if rerun.batch and Action.INSPECT_BATCH not in shown:
        lines.append(f"  the micro-batch: {shell_word(rerun.batch)}")
    return lines


def samples_lines(rerun: Optional[RerunFinding]) -> List[str]:
    """Where the failing micro-batch sits in Megatron-LM's data, one paragraph per failing replica."""
    if rerun is None or not rerun.samples:
        return []
    lines = ["Samples (the failing micro-batch in Megatron-LM's training data):"]
    for entry in rerun.samples[:MAX_LISTED]:
        lines += wrap(samples_wording(entry, entry["micro_batch"]), WIDTH, initial_indent="  ",
                               subsequent_indent="    ")
    if len(rerun.samples) > MAX_LISTED:
        lines.append(f"  ... and {len(rerun.samples) - MAX_LISTED} more data-parallel rank(s) (see --json)")
    return lines


def _origin_line(entry: Dict[str, Any], incident: Incident) -> str:
    """An origin rank, and what it is named for: where the rerun named it, its module (or its loss) and
    micro-batch; else what its records hold."""
    rerun = incident.rerun
    if entry.get("absent"):
        return f"  rank {entry['global_rank']}: no file of it in the run directory"
    if entry.get("unchecked"):
        return f"  {_rank_label(entry)}: its own gradients not checked at this step (no record of it)"
    if incident.origin_basis is OriginBasis.LINK and not entry["params"] and not entry.get("largest_grad"):
        return f"  {_rank_label(entry)}: no non-finite gradient of its own"
    if incident.origin_basis is OriginBasis.RERUN and rerun is not None:
        module = next((view["module"] for view in rerun.origins
                       if view["global_rank"] == entry["global_rank"]), None)
        if module:
            return f"  {_rank_label(entry)}: {untrusted(module)}, {micro_batch_words(rerun.micro_batch)}"
        if rerun.conclusion is Conclusion.LOSS:
            return f"  {_rank_label(entry)}: the loss of {micro_batch_words(rerun.micro_batch)}"
    return f"  {_rank_label(entry)}: {_origin_holds(entry)}"


def _origin_holds(entry: Dict[str, Any]) -> str:
    """What an origin rank is named for: its bad weights or optimizer state, its non-finite parameters, its
    own non-finite loss/gradients, the loss Megatron's check rejected, or (a norm overflow) its largest
    gradient."""
    if entry.get("kind") == RecordKind.STATE:
        weights = sorted(entry["params"], key=lambda p: p.get("copy") != "model")  # the model's own first
        names = {p["name"] for p in weights}
        more = f" and {len(names) - 1} more parameter(s)" if len(names) > 1 else ""
        parts = [f"{untrusted(p['name'])}{_element(p, entry.get('tp'))} {nonfinite_counts(p)}{more}"
                 for p in weights[:1]]
        parts += [f"{untrusted(f['state'])} of {untrusted(f['name'])}: {f['nan']} NaN, {f['inf']} Inf,"
                  f" {f['negative']} negative"
                  for f in entry.get("optimizer_state", [])[:2]]
        parts += [f"row {row['row']} of {untrusted(row['name'])} (token"
                  f" {vocabulary_token(entry.get('tp'), row['rows'], row['row'])}): largest magnitude"
                  f" {magnitude(row['largest'])}" for row in entry.get("outlying_rows", [])[:1]]
        return "; ".join(parts) or "its weights differ from its data-parallel peers'"
    if entry.get("kind") == RecordKind.REPLICA_DIVERGENCE:
        first = entry["diverged"][0] if entry.get("diverged") else None
        named = "" if first is None else f": {untrusted(first['name'])}" + (
            "" if first.get("index") is None else f"[{', '.join(map(str, first['index']))}]")
        return f"its weights differ from its data-parallel peers'{named}"
    if entry.get("kind") == RecordKind.LOSS_SCALE_OVERFLOW and not entry["params"]:
        return f"its fp16 loss scale {untrusted(entry.get('loss_scale'))}, every step skipped"
    if entry.get("own_failure"):
        return f"its own {untrusted(entry['own_failure'])} non-finite in the failing pass"
    if entry.get("kind") == RecordKind.NONFINITE_LOSS:
        return f"non-finite loss ({entry['loss']}) at {micro_batch_words(entry['micro_batch'])}"
    if entry["params"] and not entry.get("largest_grad"):
        first = entry["params"][0]
        more = f" and {entry['params_total'] - 1} more parameter(s)" if entry["params_total"] > 1 else ""
        return f"{untrusted(first['name'])}{_element(first, entry.get('tp'))} {nonfinite_counts(first)}{more}"
    if entry["params_total"] or not entry.get("largest_grad"):
        return f"{entry['params_total']} parameter(s)"
    when = " before the data-parallel collective" if entry["kind"] == RecordKind.PRE_REDUCTION else ""
    return f"largest gradient{when}: {describe_largest(entry['largest_grad'])} (finite)"


def _element(param: Dict[str, Any], tp: Any) -> str:
    """A parameter's first bad element as ``[0, 7]``, and for a weight with a row per token the token that
    row holds (``evidence.token_of``); nothing where the record names no element."""
    index = param.get("first_bad_index")
    if index is None:
        return ""
    token = token_of(tp, param)
    return f"{index}" + ("" if token is None else f" (token {token})")


def step_headline(incident: Incident) -> str:
    """The failing step as the report's first line names it (the text and the plot)."""
    return failing_step_headline(incident.step, incident.iteration, incident.kinds)


def verdict_headline(incident: Incident) -> str:
    """The verdict as the report's headline states it (the text's ``Verdict:`` line, the plot's title)."""
    return f"Verdict: {incident.verdict.cause.value}: {incident.verdict.summary}"


def runup_lines(runup: Optional[RunUp]) -> List[str]:
    """The run-up's finding; nothing where it says nothing (no rank wrote a run-up, or too few steps
    were kept to decide: ``--json`` and the plot still give why)."""
    if runup is None or runup.finding is RunUpFinding.UNDECIDED:
        return []
    return wrap(f"Run-up: {runup.summary} (gradnan report --plot draws it)", WIDTH,
                         subsequent_indent="    ")


def _next_lines(incident: Incident) -> List[str]:
    lines = ["Next:"]
    for number, step in enumerate(incident.next_steps, 1):
        lines += wrap(step.text, WIDTH, initial_indent=f"  {number}. ", subsequent_indent="     ")
        if step.command:
            lines.append(f"     {' '.join(map(shell_word, step.command))}")  # whole, on its own line
        for reading in step.health:
            lines += wrap(f"NVML at the incident (rank {reading.rank['global_rank']}): "
                                   + health_line(reading.values, reading.unread), WIDTH,
                                   initial_indent="     ", subsequent_indent="       ")
    return lines if incident.next_steps else []


def _incident_lines(incident: Incident, later_steps: Sequence[Dict[str, Any]], max_modules: int) -> List[str]:
    """What the user acts on first (the cause, the origin, what to do), then the evidence."""
    verdict = incident.verdict
    lines = [step_headline(incident)]
    lines += wrap(verdict_headline(incident), WIDTH, subsequent_indent="    ")
    origin = incident.origin
    basis = incident.origin_basis.description
    lines.append(f"Origin ({basis}):" if basis else "Origin:")
    lines += [_origin_line(entry, incident) for entry in origin[:MAX_ORIGIN_LINES]]
    if len(origin) > MAX_ORIGIN_LINES:
        lines.append(f"  ... and {len(origin) - MAX_ORIGIN_LINES} more origin entries, ranks "
                     f"{rank_ranges([entry['global_rank'] for entry in origin[MAX_ORIGIN_LINES:]])}")
    if not origin:
        lines.append("  none found")
    lines += _next_lines(incident)
    lines.append("Evidence:")
    for item in verdict.evidence:
        lines += wrap(item, WIDTH, initial_indent="  - ", subsequent_indent="    ")
    lines += rerun_lines(incident.rerun, [step.action for step in incident.next_steps], held_weight(incident))
    lines += samples_lines(incident.rerun)
    lines += runup_lines(incident.runup)
    lines += _ranks_section("Received it (through a collective or the norm's all-reduce)", incident.receivers,
                            origin)
    lines += _ranks_section("No record at this step (finite norm, or died first)", incident.silent, origin)
    if incident.parameters:
        lines += module_table(incident, max_modules, WIDTH)
    if later_steps:
        lines.append(f"Later steps with records: {', '.join(str(s['step']) for s in later_steps[:8])}"
                     + (" ..." if len(later_steps) > 8 else ""))
    return lines


def format_text(report: Report, max_modules: int = 10) -> str:
    lines = [f"gradnan report for {shell_word(report.run_dir)}"
             f"  ({len(report.ranks_seen)} rank(s) wrote files)"]
    if len(report.runs) > 1:
        listed = ", ".join(shell_word(r["run"]) + (f" (fails at step {r['first_step']})" if r["first_step"]
                                                   else "") for r in report.runs[:MAX_LISTED])
        hidden = len(report.runs) - MAX_LISTED
        more = f" and {hidden} more (see --json)" if hidden > 0 else ""
        lines.append(f"Launches here: {listed}{more}; showing {shell_word(report.run)}"
                     " (--run KEY for another)")
    incident = report.incident
    if incident is None and report.loss_scale_overflow_steps:
        steps = report.loss_scale_overflow_steps
        lines.append(f"No failure: {len(steps)} routine fp16 loss-scale overflow step(s) (skipped by dynamic"
                     f" loss scaling by design), the last at step {steps[-1]}.")
    elif incident is None:
        lines.append("No non-finite gradient was recorded.")
    else:
        lines += _incident_lines(incident, report.later_steps, max_modules)
    lines += summary_lines(report.run_dir, report.frames, report.probes, report.probes_total)
    shown = {step.command[-1] for step in (incident.next_steps if incident is not None else ())
             if step.action is Action.REPLAY and step.command}
    if incident is not None and incident.rerun is not None and incident.rerun.bundle:
        shown.add(incident.rerun.bundle)
    others = [bundle for bundle in report.bundles if bundle["path"] not in shown]
    if others:
        lines.append("Also captured for replay:" if shown else "Captured for replay:")
        lines += _listed(others, lambda bundle: [
            f"  {untrusted(bundle['module'])} on rank {bundle['global_rank']}, step {bundle['step']}:",
            f"    gradnan replay {shell_word(bundle['path'])}"], "bundle(s)")
    if incident is not None and incident.capture_settings:
        lines.append("To capture this step on a rerun from a checkpoint, set:")
        lines.append("  " + " ".join(f"{key}={shell_word(value)}"
                                     for key, value in incident.capture_settings.items()))
    lines += _listed(list(report.selftests), _selftest_lines, "self-test result(s)")
    if report.problems:
        total = report.problems_total
        lines.append(f"Files that could not be read: {total}")
        lines += [f"  {untrusted(problem, MAX_PROBLEM)}" for problem in report.problems[:MAX_LISTED]]
        if total > MAX_LISTED:
            lines.append(f"  ... and {total - MAX_LISTED} more problem(s) (see --json)")
    return printable_lines(lines)
