"""eval.py's report: the Pareto plots and the Markdown tables, from the result it writes as eval.json."""


def plot(path, curves, baselines, title, lossless=None):
    """Accuracy against tokens per forward: a curve per (name, sweep rows), tau at each point,
    a horizontal line per one-token baseline."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for name, rows in curves:
        x, y = [r["tokens_per_forward"] for r in rows], [100 * r["accuracy"] for r in rows]
        ax.plot(x, y, "o-", label=name)
        for r, xi, yi in zip(rows, x, y):
            ax.annotate(f"{r['threshold']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if lossless:
        ax.plot(lossless["tokens_per_forward"], 100 * lossless["accuracy"], "s", label="MARS lossless")
    for (name, acc), ls in zip(baselines.items(), (":", "--")):
        ax.axhline(100 * acc, ls=ls, color="gray", label=name)
    ax.set(xlabel="tokens per forward", ylabel="held-out accuracy (%)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown(result):
    pct = lambda r: f"{100 * r['accuracy']:.1f}"
    ci = lambda lo_hi: f"[{100 * lo_hi[0]:.1f}, {100 * lo_hi[1]:.1f}]"
    names = {"ar": "AR SFT (stage 1)", "control": "control (stage 1 + AR steps)", "lossless": "MARS lossless"}
    row_name = lambda r: names.get(r["decoder"], f"MARS tau={r['threshold']}")
    q = result["quality"]
    tasks = list(q[0]["per_task"])
    lines = [f"Quality ({result['n_test']} held-out prompts, B = {result['B']}): accuracy % with 95% interval, "
             "tokens/forward (ours: output tokens / the row's forwards), accuracy per family", "",
             "| decoder | all | 95% CI | tokens/forward (ours) | " + " | ".join(tasks) + " |",
             "|---" * (len(tasks) + 4) + "|"]
    for r in q:
        cells = [pct(r), ci(r["ci"]), f"{r['tokens_per_forward']:.2f}"]
        cells += [f"{round(100 * r['per_task'][t]['accuracy'], 1):g}" for t in tasks]  # one prompt of 200 is half a point
        lines.append(f"| {row_name(r)} | " + " | ".join(cells) + " |")
    same = result["identical_to_ar"]
    lines += ["", f"Token for token against the MARS checkpoint decoded as AR (--ar): lossless differs on "
              f"{same['lossless_differ']} of {same['n']} prompts, tau = 1.0 on {same['tau1_differ']}."]
    for title, key in (("per task family", "per_task"), ("per answer length (reference tokens, <|endoftext|> included)",
                                                         "per_length")):
        groups = list(q[0][key])
        sizes = " | ".join(f"{g} (n={q[0][key][g]['n']})" for g in groups)
        lines += ["", f"Where MARS pays, {title}: accuracy % (tokens/forward, ours)", "",
                  f"| decoder | {sizes} |", "|---" * (len(groups) + 1) + "|"]
        for r in q:
            lines.append(f"| {row_name(r)} | " + " | ".join(
                f"{pct(r[key][g])} ({r[key][g]['tokens_per_forward']:.2f})" for g in groups) + " |")
    lines += ["", "Paired on the same prompts: difference in points, 95% interval (Newcombe's, for paired "
              "proportions), exact McNemar p", "",
              "| comparison | difference | 95% CI | p | right only in a / only in b |", "|---|---|---|---|---|"]
    for p in result["paired"]:
        lines.append(f"| {p['a']} vs {p['b']} | {100 * p['diff']:+.1f} | {ci(p['ci'])} | {p['p_value']:.3g} | "
                     f"{p['a_only']} / {p['b_only']} |")
    for title, what, sweeps in (("Ablations: accuracy % (tokens/forward) per checkpoint", "checkpoint",
                                 [(a["label"], a["sweep"]) for a in result["ablations"]]),
                                ("Confidence metrics (first checkpoint): accuracy % (tokens/forward)", "metric",
                                 list(result["metrics"].items()))):
        taus = [r["threshold"] for r in sweeps[0][1]]
        lines += ["", title, "", f"| {what} | " + " | ".join(f"tau={t}" for t in taus) + " |",
                  "|---" * (len(taus) + 1) + "|"]
        for name, rows in sweeps:
            lines.append(f"| {name} | " + " | ".join(f"{pct(r)} ({r['tokens_per_forward']:.2f})" for r in rows) + " |")
    lines += ["", result["entropy_note"], "",
              f"Wall clock ({result['speed_prompts']} prompts, {result['repeats']} repeats; {result['machine']}; "
              f"{result['device']}); speedup against AR at the same batch size: the median over repeats of the "
              "per-repeat ratio of tokens/s [min, max]; tokens/forward, ours and the official samplers' counter "
              "(whole batch), from the same timed passes", "",
              "| decoder | batch | tau | cache_block | tokens/forward (ours) | tokens/forward (official) | tokens/s | "
              "speedup vs AR |", "|---|---|---|---|---|---|---|---|"]
    for s in result["speed"]:
        lo, hi = s["speedup_spread"]
        lines.append(f"| {s['decoder']} | {s['batch_size']} | {s['threshold'] or '-'} | {s['cache_block'] or '-'} | "
                     f"{s['tokens_per_forward']:.2f} | {s['tokens_per_forward_official']:.2f} | "
                     f"{s['tokens_per_second']:.0f} | "
                     f"{s['speedup']:.2f}x [{lo:.2f}, {hi:.2f}] |")
    lines += ["", "AR's own bracket is the range of its rate over the run, over its median: the drift that "
              "alternating AR and the decoder batch by batch keeps out of the ratios.",
              "", f"For comparison, the {result['paper_table5']}."]
    return "\n".join(lines)
