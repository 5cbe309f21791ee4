"""The mixed-context tail before and after its bound, on the committed H200 observe files.

Prices the mixed decode steps (longest context >= 1.25 x the mean, as validate's tail fit) of
every arm with validate's own pricing (price_steps: the arm's table, engine sizes and grid),
under four rules: vLLM's one curve (the table's 8192 context), the KV sum (tail 0), the tail
0.2 as served until this change (S + t (n max - S)), and pricing.rules.tail_context_sum (the
bounded tail, 0.2); and, on the arms the rule was chosen on, the candidates it was chosen among.
Errors: median / p90 absolute % and median signed % (> 0: priced too
slow), per set of arms (the arms the rule was chosen on, the held-out ones), workload, kind
and mean-context bucket. Run from the repository root:

    python benchmarks/results/h200/2026-12-01-2043-skewed/tail_rules.py
"""

from __future__ import annotations

import glob
import os

import numpy as np

from dspark_calib.observe.file import read_observed
from dspark_calib.pricing.rules import tail_context_sum
from dspark_calib.table.file import read_table
from dspark_calib.validate import MIXED_SPREAD, ErrorStats, bucket_label, pow2_bucket, price_steps

R = "benchmarks/results/h200/"
AB = R + "2026-12-01-0438-context/h200-tp1-ctx3-serve.parquet"  # ab68151477b4: served at 1945, 2320, 0438
SHIP = "profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"
RUNS = {"1945": ("2026-11-30-1945-context/", AB), "2320": ("2026-11-30-2320-context/", AB),
        "0438": ("2026-12-01-0438-context/", AB), "0742": ("2026-12-01-0742-context/", SHIP),
        "1547": ("2026-12-01-1547-relayout-smoke/", SHIP), "skewed": ("2026-12-01-2043-skewed/", SHIP)}


def arm(name):
    """(name, observe file, table) of an arm named 'RUN [HOST] ARM' (the 15:47 smoke: its one arm)."""
    run, _, rest = name.partition(" ")
    folder, table = RUNS[run]
    if run == "skewed":
        return name, R + folder + rest + "/observed-*.parquet", table
    host, _, which = rest.rpartition(" ")
    which = "aware-tail20-chunks" if run == "1547" else which
    return name, R + folder + (host + "/" if host else "") + f"context-{which}-observed.parquet", table


# chosen on: the ten arms the tail 0.2 was fitted on and today's stock; judged on the others
CHOSEN_ON = [arm(a) for a in ("1945 stock", "1945 static", "1945 aware", "2320 host1 stock", "2320 host2 stock",
                              "2320 host2 aware", "0438 stock", "0438 stock-rerun", "0438 aware",
                              "0438 aware-tail20-chunks", "skewed stock")]
HELD_OUT = [arm(a) for a in ("0742 stock", "0742 aware", "0742 aware-tail20-chunks", "1547 smoke",
                             "skewed stock-rerun", "skewed aware-tail20-chunks", "skewed aware-chunks")]
RULES = ("vLLM 8192", "tail 0", "tail 0.2 before", "tail 0.2 bounded")


def unbounded(s, mx, n, t=200):
    """The tail as served until this change: S + t (n max - S)."""
    return s + (t * (mx * n - s)) // 1000


def capped(s, mx, n, t=200):
    """A candidate: the gap counted up to S (the tail saturates at max = 2 x mean)."""
    return s + (t * np.minimum(mx * n - s, s)) // 1000


def spread(s, mx, n, t=800):
    """A candidate: t S f (1 - f), f = mean / max (a new constant, 0.8, chosen on these arms)."""
    return s + (t * ((mx * n - s) * s // (mx * n)) // 1000) * s // (mx * n)


CANDIDATES = {"tail 0": lambda s, mx, n: s, "tail 0.2 before": unbounded, "capped at S (0.2)": capped,
              "t S f (1 - f) (0.8)": spread, "tail 0.2 bounded": lambda s, mx, n: tail_context_sum(s, mx, n, 200)}


def arm_steps(path, table_path, tables={}, rules=None):
    """Per mixed decode step of one arm: kind masks, buckets, measured and predicted ms per rule."""
    table = tables.setdefault(table_path, read_table(table_path))
    obs = read_observed(sorted(glob.glob(path)))
    p = price_steps(table, obs)
    c = obs.columns
    s, mx, n, tokens = c["context_sum"], c["context_max"], c["num_reqs"], c["num_target_tokens"]
    mixed = mx * n >= MIXED_SPREAD * s
    rules = rules or {r: CANDIDATES[r] for r in RULES[1:]}
    pred = {rule: dict(zip(("draft", "verify"), p.grid.price(f(s, mx, n), n, tokens))) for rule, f in rules.items()}
    pred["vLLM 8192"] = {"draft": p.predicted["draft"]["single_context"], "verify": p.predicted["verify"]["single_context"]}
    masks = {"draft": p.steps["draft"] & mixed, "verify": p.steps["verify"] & mixed}
    measured = {"draft": c["drafter_ms"], "verify": c["forward_ms"]}
    return masks, pow2_bucket(c["context_mean"].astype(np.int64), 1024), measured, pred


def table(arms):
    """Markdown rows: workload, kind, context bucket, steps, then each rule's median / p90 (bias)."""
    groups = {}
    for name, path, table_path in arms:
        workload = "skewed" if name.startswith("skewed") else "1k/8k/16k runs"
        masks, bucket, measured, pred = arm_steps(path, table_path)
        for kind, mask in masks.items():
            for b in [None, *np.unique(bucket[mask])]:
                sel = mask if b is None else mask & (bucket == b)
                label = "all" if b is None else bucket_label(int(b), 1024)
                g = groups.setdefault((workload, kind, label), {"measured": [], **{r: [] for r in RULES}})
                g["measured"].append(measured[kind][sel])
                for rule in RULES:
                    g[rule].append(pred[rule][kind][sel])
    rows = []
    for (workload, kind, label), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "all",
                                                                              int(kv[0][2].split("-")[0] or 0)
                                                                              if kv[0][2] != "all" else 0)):
        measured = np.concatenate(g["measured"])
        cells = []
        for rule in RULES:
            e = ErrorStats.of(np.concatenate(g[rule]), measured)
            cells.append(f"{e.median_pct:.2f} / {e.p90_pct:.2f} ({e.median_signed_pct:+.2f})")
        rows.append(f"| {workload} | {kind} | {label} | {len(measured)} | " + " | ".join(cells) + " |")
    return rows


def candidates(arms):
    """Markdown rows: each candidate's median (bias) per workload and kind, all mixed steps."""
    pooled = {}
    for name, path, table_path in arms:
        workload = "skewed" if name.startswith("skewed") else "1k/8k/16k runs"
        masks, _, measured, pred = arm_steps(path, table_path, rules=CANDIDATES)
        for kind, mask in masks.items():
            g = pooled.setdefault((workload, kind), {"measured": [], **{r: [] for r in CANDIDATES}})
            g["measured"].append(measured[kind][mask])
            for rule in CANDIDATES:
                g[rule].append(pred[rule][kind][mask])
    rows = []
    for rule in CANDIDATES:
        cells = []
        for key in sorted(pooled):
            e = ErrorStats.of(np.concatenate(pooled[key][rule]), np.concatenate(pooled[key]["measured"]))
            cells.append(f"{e.median_pct:.2f} ({e.median_signed_pct:+.2f})")
        rows.append(f"| {rule} | " + " | ".join(cells) + " |")
    return ["| rule | " + " | ".join(f"{w} {k}" for w, k in sorted(pooled)) + " |",
            "|" + "---|" * (1 + len(pooled)), *rows]


def kv_factors(arms):
    """Markdown rows: per arm, the median gap G / S of its mixed decode steps and the median k at
    which the table's verify cost at k S equals the step's measured one (the KV the step ran as)."""
    rows = ["| arm | mixed decode steps | median G / S | median k (p10..p90) |", "|---|---|---|---|"]
    ks = np.linspace(0.5, 8.0, 751)
    for name, path, table_path in arms:
        table = read_table(table_path)
        obs = read_observed(sorted(glob.glob(path)))
        p = price_steps(table, obs)
        c = obs.columns
        s, mx, n, tokens = c["context_sum"], c["context_max"], c["num_reqs"], c["num_target_tokens"]
        sel = p.steps["verify"] & (mx * n >= MIXED_SPREAD * s)
        cost = np.array([p.grid.price((s[sel] * k).astype(np.int64), n[sel], tokens[sel])[1] for k in ks])
        k = np.array([np.interp(m, cost[:, j], ks) for j, m in enumerate(c["forward_ms"][sel])])
        gap = (mx * n - s)[sel] / s[sel]
        rows.append(f"| {name} | {int(sel.sum())} | {np.median(gap):.2f} | {np.median(k):.3f} "
                    f"({np.percentile(k, 10):.3f}..{np.percentile(k, 90):.3f}) |")
    return rows


def main():
    print("the KV each arm's mixed decode steps ran as:\n")
    print("\n".join(kv_factors(CHOSEN_ON + HELD_OUT)))
    print()
    print("candidates, on the arms the rule was chosen on (median (bias) %):\n")
    print("\n".join(candidates(CHOSEN_ON)))
    head = "| workload | kind | mean context | steps | " + " | ".join(RULES) + " |"
    skewed = [a for a in CHOSEN_ON + HELD_OUT if a[0].startswith("skewed")]
    for title, arms in (("chosen on", CHOSEN_ON), ("held out", HELD_OUT), *((a[0], [a]) for a in skewed)):
        print(f"\n{title}" + (f": {', '.join(a[0] for a in arms)}" if len(arms) > 1 else "") + "\n")
        print(head)
        print("|" + "---|" * (4 + len(RULES)))
        print("\n".join(table(arms)))


if __name__ == "__main__":
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
    main()
