"""Judge several cost tables on one served arm's steps, with the workloads split into the ones a
choice is decided on and the ones it is reported on (held out).

    python3 benchmarks/serving/judge_tables.py RESULTS ARM --table NAME=PATH [--table NAME=PATH ...]
        --decide WORKLOAD[,WORKLOAD...] [--json OUT.json] [--md OUT.md]

RESULTS is a serving run's folder (serve_context.py arm ... --out RESULTS) and ARM an arm that
observed (context-ARM.json and context-ARM-observed.parquet there). Each table prices the arm's
observed steps as `dspark-calib validate` does (context-aware and at the table's context nearest
vLLM's 8192: vLLM's one curve), per kind (drafts, decode verifies, prefill-carrying verifies) and
context bucket (powers of two), once over the --decide workloads' steps and once over the rest.
A table of another engine than the one the observe files record (a blocking fingerprint key
differs) is not judged, and says why; the other tables still are. A table, a profile state or a
correction is chosen on the first part; only the second says how
well the choice prices steps it was not chosen on (a choice judged on its own steps looks better
than it is). The goal line reads the held-out part: every bucket with at least MIN_STEPS steps
within GOAL_MEDIAN_PCT median and GOAL_BIAS_PCT bias. The held-out steps are also shown by the SM
clock sampled with each step and, for decode verifies, by shape (validate's ShapeErrors): whether
the residuals follow the GPU's clock or the step's requests against the profile's; and the
prefill-carrying ones by their chunks' query-context pairs (the attention work the chunk rule
prices per pair): whether they follow the chunk's attention.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_context as sc  # noqa: E402 - a sibling script, found by the path above

GOAL_MEDIAN_PCT = 2.0
GOAL_BIAS_PCT = 1.0
MIN_STEPS = 20
PARTS = ("decide", "held_out")
PAIR_EDGES_M = (16, 32, 64)  # millions of query-context pairs a prefill-carrying step's chunks hold
PAIR_LABELS = ("<16M", "16M-32M", "32M-64M", ">=64M")


def split_rows(arm_json: dict[str, Any], cols: dict[str, Any], decide: set[str]) -> dict[str, Any]:
    """The step rows of the decide workloads and of the others, segmented as the harness segments
    an arm's observe file (by its marker batches); refused when the markers do not say it."""
    import numpy as np

    workloads = list(arm_json.get("workloads", {}))
    unknown = decide - set(workloads)
    if unknown:
        raise ValueError(f"--decide {', '.join(sorted(unknown))}: not a workload of this arm ({', '.join(workloads)})")
    if not decide or decide == set(workloads):
        raise ValueError("--decide must name some of the arm's workloads and leave others held out")
    segments, why = sc.segment_steps(cols, len(workloads))
    if segments is None:
        raise ValueError(f"cannot split the observed steps by workload: {why}")
    pick = {p: [seg for w, seg in zip(workloads, segments) if (w in decide) == (p == "decide")] for p in PARTS}
    return {p: np.concatenate(segs) if segs else np.array([], dtype=int) for p, segs in pick.items()}


def arm_parts(results: str, arm: str, decide: set[str]) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """An observing arm's summary, its observe files, and their steps split into the decide and the
    held-out part (split_rows), each an ObservedSteps of the files' steps; an empty part left out."""
    from dspark_calib.observe.file import ObservedSteps, read_observed

    with open(os.path.join(results, f"context-{arm}.json")) as fh:
        arm_json = json.load(fh)
    obs = read_observed([os.path.join(results, f"context-{arm}-observed.parquet")])
    cols = sc.sorted_columns(dict(obs.columns))
    parts = {part: ObservedSteps({k: v[picked] for k, v in cols.items()}, obs.files, obs.metadata)
             for part, picked in split_rows(arm_json, cols, decide).items()}
    return arm_json, obs, {part: sub for part, sub in parts.items() if len(sub)}


def judge(tables: dict[str, str], results: str, arm: str, decide: set[str]) -> dict[str, Any]:
    from dspark_calib.errors import CalibError
    from dspark_calib.table.file import read_table
    from dspark_calib.validate import AWARE, SINGLE, validate

    arm_json, obs, parts = arm_parts(results, arm, decide)
    workloads = list(arm_json["workloads"])
    out: dict[str, Any] = {"arm": arm, "results": results, "host": arm_json.get("host"),
                           "workloads": {"decide": [w for w in workloads if w in decide],
                                         "held_out": [w for w in workloads if w not in decide]},
                           "tables": {}, "rows": [], "by_clock": [], "by_shape": [], "by_pairs": [], "goal": {}}
    for name, path in tables.items():
        try:  # one table that cannot price these steps costs its own rows, not the others'
            table = read_table(path)
            recorded = [meta.check_engine(table.fingerprint, file) for file, meta in zip(obs.files, obs.metadata)]
            if not all(recorded):  # files before the engine was recorded: the arm's own speculator
                problem = speculator_mismatch(table.fingerprint.to_dict(), arm_json)
                if problem:
                    raise CalibError(f"served by another speculator than the table's: {problem}")
            rows = []
            for part, sub in parts.items():
                result = validate(table, sub)
                rows += [{"table": name, "part": part, "kind": g.kind, "context_bucket": g.context_bucket,
                          "steps": g.errors[AWARE].n, "one_curve": g.errors[SINGLE].to_dict(),
                          "context_aware": g.errors[AWARE].to_dict()}
                         for g in list(result.overall) + list(result.by_context)]
                out["by_clock"] += [{"table": name, "part": part, "kind": c.kind, "clock_bucket_mhz": c.clock_bucket,
                                     "steps": c.errors[AWARE].n, "context_aware": c.errors[AWARE].to_dict()}
                                    for c in result.by_clock]
                out["by_shape"] += [{"table": name, "part": part, "kind": g.kind, "context_bucket": g.context_bucket,
                                     "fill_bucket": g.fill_bucket, "steps": g.errors[AWARE].n,
                                     "context_aware": g.errors[AWARE].to_dict()} for g in result.by_shape]
                out["by_pairs"] += [{"table": name, "part": part, **g} for g in pair_errors(table, sub)]
        except CalibError as exc:
            out["tables"][name] = {"path": path, "error": str(exc)}
            continue
        out["tables"][name] = {"path": path, "hash": table.content_hash[:12],
                               "gpu_state": table.fingerprint.to_dict().get("gpu_state")}
        out["rows"] += rows
        out["goal"][name] = goal(out["rows"], name)
    return out


def pair_errors(table: Any, observed: Any) -> list[dict[str, Any]]:
    """The prefill-carrying steps' context-aware errors per PAIR_LABELS bucket of their chunks'
    query-context pairs (observe's prefill_pairs); steps that recorded none are left out."""
    import numpy as np

    from dspark_calib.validate import AWARE, ErrorStats, price_steps

    p = price_steps(table, observed)
    keep = np.asarray(p.steps["verify_prefill"]) & (observed.columns["prefill_pairs"] > 0)
    bucket = np.searchsorted(np.asarray(PAIR_EDGES_M) * 1e6, observed.columns["prefill_pairs"], side="right")
    predicted = np.asarray(p.predicted["verify_prefill"][AWARE], dtype=float)
    measured = np.asarray(observed.columns["forward_ms"], dtype=float)
    return [{"pairs": label, "steps": int(sel.sum()),
             "context_aware": ErrorStats.of(predicted[sel], measured[sel]).to_dict()}
            for b, label in enumerate(PAIR_LABELS) for sel in [keep & (bucket == b)] if sel.any()]


def speculator_mismatch(fp: dict[str, Any], arm_json: dict[str, Any]) -> str | None:
    """The first of the table's speculator keys the arm's engine (its summary's speculative_config)
    says otherwise, as "key: table X, arm Y", or None."""
    spec = (arm_json.get("engine") or {}).get("speculative_config") or {}
    draft = os.path.basename(str(spec.get("model") or "").rstrip("/")) or None
    for key, served in (("speculative_method", spec.get("method")), ("draft_model", draft),
                        ("num_speculative_tokens", spec.get("num_speculative_tokens"))):
        if served is not None and fp.get(key) is not None and str(fp[key]) != str(served):
            return f"{key}: table {fp[key]}, arm {served}"
    return None


def goal(rows: list[dict[str, Any]], table: str) -> dict[str, Any]:
    """The held-out buckets of one table with at least MIN_STEPS steps, and the ones that miss."""
    judged = [r for r in rows if r["table"] == table and r["part"] == "held_out" and r["context_bucket"] != "all"
              and r["steps"] >= MIN_STEPS]
    misses = [f"{r['kind']} {r['context_bucket']}: {r['context_aware']['median_pct']:.2f} % "
              f"(bias {r['context_aware']['median_signed_pct']:+.2f} %)"
              for r in judged if r["context_aware"]["median_pct"] > GOAL_MEDIAN_PCT
              or abs(r["context_aware"]["median_signed_pct"]) > GOAL_BIAS_PCT]
    return {"buckets": len(judged), "met": bool(judged) and not misses, "misses": misses}


def markdown(doc: dict[str, Any]) -> str:
    names = list(doc["tables"])
    lines = [f"Tables judged on arm `{doc['arm']}` ({doc['results']}); decided on "
             f"{', '.join(doc['workloads']['decide'])}, held out: {', '.join(doc['workloads']['held_out'])}.", ""]
    for n, t in doc["tables"].items():
        lines.append(f"- {n}: `{t['path']}` " + (f"not judged: {t['error']}" if "error" in t else
                                                  f"(hash {t['hash']}, GPU state {t['gpu_state'] or 'startup'})"))
    names = [n for n in names if "error" not in doc["tables"][n]]
    if not names:
        return "\n".join(lines) + "\n"
    for part in PARTS:
        rows = [r for r in doc["rows"] if r["part"] == part]
        if not rows:
            continue
        lines += ["", f"{'Decide' if part == 'decide' else 'Held out'}: median absolute error % (bias %) per kind "
                      f"and context bucket; the one curve is {names[0]}'s at its context nearest 8192:", "",
                  "| kind | context | steps | one curve | " + " | ".join(names) + " |",
                  "|---|---|---:|---:|" + "---:|" * len(names)]
        keys = list(dict.fromkeys((r["kind"], r["context_bucket"]) for r in rows))
        for kind, bucket in keys:
            got = {r["table"]: r for r in rows if (r["kind"], r["context_bucket"]) == (kind, bucket)}
            first = got.get(names[0])  # every table prices the same steps: the first one's count and one curve
            cells = [_cell(got[n]["context_aware"]) if n in got else "-" for n in names]
            lines.append(f"| {kind} | {bucket} | {first['steps'] if first else '-'} | "
                         f"{_cell(first['one_curve']) if first else '-'} | " + " | ".join(cells) + " |")
    clocked = [c for c in doc["by_clock"] if c["part"] == "held_out" and c["table"] in names]
    if clocked:
        lines += ["", "Held out, by the GPU's SM clock as sampled with each step (context-aware pricing; the profile's "
                      "blocks ran at the clocks its telemetry records: `dspark-calib inspect TABLE`):", "",
                  "| kind | SM MHz | steps | " + " | ".join(names) + " |", "|---|---|---:|" + "---:|" * len(names)]
        for kind, bucket in dict.fromkeys((c["kind"], c["clock_bucket_mhz"]) for c in clocked):
            got = {c["table"]: c for c in clocked if (c["kind"], c["clock_bucket_mhz"]) == (kind, bucket)}
            steps = next(iter(got.values()))["steps"]
            lines.append(f"| {kind} | {bucket} | {steps} | "
                         + " | ".join(_cell(got[n]["context_aware"]) if n in got else "-" for n in names) + " |")
    shaped = [g for g in doc["by_shape"] if g["part"] == "held_out" and g["table"] in names]
    if shaped:
        lines += ["", "Held out, decode verifies by shape: the step's requests over the R(N) = min(N, max_num_seqs) "
                      "requests the profile times at its size N (> 0.9: the profile's own shape; fewer: longer "
                      "requests at the same KV read, a shape no profile runs):", "",
                  "| context | requests / R(N) | steps | " + " | ".join(names) + " |",
                  "|---|---|---:|" + "---:|" * len(names)]
        for bucket, fill in dict.fromkeys((g["context_bucket"], g["fill_bucket"]) for g in shaped):
            got = {g["table"]: g for g in shaped if (g["context_bucket"], g["fill_bucket"]) == (bucket, fill)}
            steps = next(iter(got.values()))["steps"]
            lines.append(f"| {bucket} | {fill} | {steps} | "
                         + " | ".join(_cell(got[n]["context_aware"]) if n in got else "-" for n in names) + " |")
    paired = [g for g in doc.get("by_pairs", []) if g["part"] == "held_out" and g["table"] in names]
    if paired:
        lines += ["", "Held out, prefill-carrying steps by their chunks' query-context pairs (the attention work the "
                      "chunk rule prices per pair):", "",
                  "| pairs | steps | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
        for bucket in dict.fromkeys(g["pairs"] for g in paired):
            got = {g["table"]: g for g in paired if g["pairs"] == bucket}
            lines.append(f"| {bucket} | {next(iter(got.values()))['steps']} | "
                         + " | ".join(_cell(got[n]["context_aware"]) if n in got else "-" for n in names) + " |")
    lines += ["", f"Goal on the held-out part (every bucket of >= {MIN_STEPS} steps within {GOAL_MEDIAN_PCT:g} % median "
                  f"and {GOAL_BIAS_PCT:g} % bias):", ""]
    for n, g in doc["goal"].items():
        if not g["buckets"]:
            lines.append(f"- {n}: not judged: no held-out bucket has {MIN_STEPS} steps")
            continue
        lines.append(f"- {n}: {'met' if g['met'] else 'not met'} over {g['buckets']} buckets"
                     + (f"; misses: {'; '.join(g['misses'])}" if g["misses"] else ""))
    return "\n".join(lines) + "\n"


def _cell(stats: dict[str, Any]) -> str:
    if stats.get("median_pct") is None:
        return "-"
    return f"{stats['median_pct']:.2f} ({stats['median_signed_pct']:+.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results")
    p.add_argument("arm")
    p.add_argument("--table", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--decide", required=True, help="comma list of the workloads a choice is decided on")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    tables = {}
    for t in args.table:
        name, eq, path = t.partition("=")
        if not eq or not name or not os.path.isfile(path):
            print(f"--table {t}: give NAME=PATH of an existing table", file=sys.stderr)
            return 2
        if name in tables:
            print(f"--table {t}: the name {name} is given twice", file=sys.stderr)
            return 2
        tables[name] = path
    return run("judge_tables", args, lambda: judge(tables, args.results, args.arm, set(args.decide.split(","))),
               markdown)


def missing_output_dir(args: argparse.Namespace) -> bool:
    """--json / --md into a folder that does not exist: said in one line (before any work)."""
    for option, target in (("--json", args.json), ("--md", args.md)):
        if target and not os.path.isdir(os.path.dirname(os.path.abspath(target))):
            print(f"{option} {target}: no such directory", file=sys.stderr)
            return True
    return False


def run(script: str, args: argparse.Namespace, build: Any, render: Any) -> int:
    """The analysis scripts' common end: --json / --md checked, the document built, a bad file or
    option said in one line on stderr (exit 2), else the document emitted (exit 0)."""
    if missing_output_dir(args):
        return 2
    from dspark_calib.errors import CalibError

    try:
        doc = build()
    except (OSError, ValueError, KeyError, CalibError) as exc:  # one line: a file or an option, named
        print(f"{script}: {exc}", file=sys.stderr)
        return 2
    emit(doc, render(doc), args)
    return 0


def emit(doc: dict[str, Any], md: str, args: argparse.Namespace) -> None:
    """The document to --json, its markdown to --md and to stdout."""
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
