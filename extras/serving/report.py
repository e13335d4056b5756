"""The load experiment's report (python -m extras.serving.serve, with or without --http_load): its goals,
a Markdown table, and the figure (serve.png): arrivals, adaptive tau and backlog over time; p99
latency and accuracy against the arrival rate."""
import numpy as np


def goals(result):
    """The three goals, measured: overload p99 of adaptive / tau = 1.0 (<= p99_goal: 1/3, over HTTP 1/2),
    whole-trace accuracy of adaptive minus tau = 1.0 in points (>= -1), the adaptive mean tau of the light
    phases (>= 0.99)."""
    run = {(r["policy"], r["phase"]): r for r in result["runs"]}
    whole = {r["policy"]: r for r in result["whole_trace"]}
    light = [run[("adaptive", p)] for p in ("light", "recovery")]
    return {"overload_p99_ratio": run[("adaptive", "overload")]["p99_latency"] / run[("tau=1.0", "overload")]["p99_latency"],
            "accuracy_points": 100 * (whole["adaptive"]["accuracy"] - whole["tau=1.0"]["accuracy"]),
            "light_mean_tau": min(r["mean_tau"] for r in light)}


def markdown(result):
    cols = "| policy | phase | rate (req/s) | requests | latency p50 / p99 (s) | TTFT p50 / p99 (s) | tokens/s | " \
           "goodput (req/s) | tokens/forward | mean tau | accuracy |"
    lines = [f"Serving under load ({result['clock']} clock, max_batch {result['max_batch']}, SLO "
             f"{result['slo_seconds']:.3f} s, B = {result['B']}; {result['machine']})", "", cols, "|---" * 11 + "|"]
    for r in result["runs"] + [{**w, "phase": "whole trace"} for w in result["whole_trace"]]:
        lines.append(f"| {r['policy']} | {r['phase']} | {r['rate']:.1f} | {r['requests']} | {r['p50_latency']:.3f} / "
                     f"{r['p99_latency']:.3f} | {r['p50_ttft']:.3f} / {r['p99_ttft']:.3f} | {r['tokens_per_second']:.0f} | "
                     f"{r['goodput']:.1f} | {r['tokens_per_forward']:.2f} | {r['mean_tau']:.3f} | {100 * r['accuracy']:.1f} |")
    g = result["goals"]
    lines += ["", f"Goals: overload p99 adaptive / tau=1.0 = {g['overload_p99_ratio']:.2f} "
                  f"(<= {result.get('p99_goal', 1 / 3):.2f}); whole-trace "
                  f"accuracy adaptive - tau=1.0 = {g['accuracy_points']:+.1f} points (>= -1); light-phase mean tau "
                  f"of adaptive = {g['light_mean_tau']:.3f} (>= 0.99)"]
    return "\n".join(lines)


def plot(result, timelines, arrivals, path):
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    fig = Figure(figsize=(13, 6))
    grid = fig.add_gridspec(2, 2)
    ax_rate, ax_sweep = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[:, 1])
    ax_backlog = fig.add_subplot(grid[1, 0], sharex=ax_rate)

    # panel 1, over time: arrival rate and adaptive tau (top), backlog per policy (bottom)
    end = sum(p["seconds"] for p in result["phases"])
    bins = np.linspace(0, end, 31)
    counts, _ = np.histogram(arrivals, bins)
    ax_rate.stairs(counts / np.diff(bins), bins, fill=True, color="0.8", label="arrivals")
    ax_rate.set(ylabel="arrivals (requests/s)", title="the trace: light, overload, recovery")
    ax_tau = ax_rate.twinx()
    t, _, tau, _ = zip(*timelines["adaptive"])
    ax_tau.step(t, tau, where="pre", color="C3", label="adaptive tau")
    ax_tau.set(ylabel="adaptive tau", ylim=(min(result["ladder"]) - 0.02, 1.01))
    ax_rate.legend(loc="upper left"), ax_tau.legend(loc="upper right")
    for policy, steps in timelines.items():
        t, backlog, _, _ = zip(*steps)
        wide = policy == "ar"  # under tau = 1.0, which feeds exactly what it feeds
        ax_backlog.step(t, backlog, where="pre", label=policy, lw=4 if wide else 1, alpha=0.4 if wide else 1)
    ax_backlog.set(xlabel="time (s)", ylabel="backlog (waiting + running)"), ax_backlog.legend(loc="upper left")
    for ax in (ax_rate, ax_backlog):
        for edge in np.cumsum([p["seconds"] for p in result["phases"]])[:-1]:
            ax.axvline(edge, ls=":", color="k")

    # panel 2: p99 latency (solid) and accuracy (dashed) against the arrival rate
    ax_acc = ax_sweep.twinx()
    for i, policy in enumerate(dict.fromkeys(r["policy"] for r in result["sweep"])):
        rows = [r for r in result["sweep"] if r["policy"] == policy]
        rate = [r["rate"] for r in rows]
        ax_sweep.plot(rate, [r["p99_latency"] for r in rows], "o-", color=f"C{i}", label=f"{policy} p99")
        ax_acc.plot(rate, [100 * r["accuracy"] for r in rows], "s--", color=f"C{i}", alpha=0.6, clip_on=False)
    ax_sweep.axvline(result["capacity"]["tau=1.0"], ls=":", color="k")
    ax_sweep.axhline(result["slo_seconds"], ls=":", color="gray")
    ax_sweep.set(xlabel="arrival rate (requests/s); dotted: tau = 1.0 capacity", ylabel="p99 latency (s), log",
                 yscale="log", title="steady load: p99 latency (solid), accuracy (dashed)")
    ax_acc.set_ylim(top=100)  # an accuracy ends at 100%; the markers at 100 stay whole (clip_on)
    ax_acc.set(ylabel="accuracy (%), the same requests at every rate"), ax_sweep.legend(loc="upper left")
    fig.tight_layout(), fig.savefig(path, dpi=100)
