"""bench/plots.py: the README's plots (img/), drawn from the results dict benchmark.py
wrote; the tables are report.py's. Needs matplotlib (optional: pip install matplotlib).
"""
import os


def plots(results, img_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plots skipped (pip install matplotlib)"
    os.makedirs(img_dir, exist_ok=True)
    written = []
    if results["models"]:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        for size, r in results["models"].items():
            d = [x for x in r["decode"] if x["cache"]]
            a1.plot([x["batch"] for x in d], [x["end_to_end_tok_s"] for x in d], "o-", label=f"{size} (this project)")
            if isinstance(r.get("transformers"), list):  # not None (not installed), not {"failed": why}
                a1.plot([t["batch"] for t in r["transformers"]], [t["tok_s"] for t in r["transformers"]], "x--",
                        label=f"{size} (transformers)")
            a2.plot([c["context"] for c in r["context"]], [c["cached_ms"] for c in r["context"]], "o-",
                    label=f"{size} cache")
            a2.plot([c["context"] for c in r["context"]], [c["uncached_ms"] for c in r["context"]], "x--",
                    label=f"{size} no cache")
        a1.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s, prefill included",
               title="Throughput vs batch")
        a2.set(yscale="log", xlabel="context length", ylabel="ms per token", title="KV cache vs recomputation")
        a1.legend(fontsize=7)
        a2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(img_dir, "decode.png"), dpi=120)
        written.append("decode.png")
    if "speculative" in results:
        s = results["speculative"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        for vocab in dict.fromkeys(e["draft_vocab"] for e in s["end_to_end"][1:]):
            rows = [e for e in s["end_to_end"][1:] if e["draft_vocab"] == vocab and e["K"] == s["K"]]
            label = "full draft head" if not vocab else f"draft head over {vocab} tokens"
            a1.plot([e["a"] for e in rows], [e["speedup"] for e in rows], "o-", label=f"measured, {label}")
            a1.plot([e["a"] for e in rows], [e["predicted"] for e in rows], "x--",
                    label=f"predicted by the table, {label}")
            a1.plot([e["a"] for e in rows], [e["predicted_beside"] for e in rows], "s:", markersize=3,
                    label=f"predicted beside each run, {label}")
        a1.axhline(1, color="grey", lw=0.5)
        a1.set(xlabel="acceptance rate a", ylabel="speedup over plain decoding",
               title=f"{s['draft']} -> {s['target']}, K={s['K']}, on this CPU")
        a1.legend(fontsize=7)
        Ks = [k["K"] for k in s["by_K"]]
        a2.bar([str(k) for k in Ks], [k["verify_over_step"] for k in s["by_K"]])
        a2.axhline(1, color="grey", lw=0.5)
        a2.set(xlabel="K", ylabel="verify(K+1) / one decode step", title="Cost of verifying K+1 tokens")
        fig.tight_layout()
        fig.savefig(os.path.join(img_dir, "speculative.png"), dpi=120)
        written.append("speculative.png")
    if "serving" in results:
        serving_plot(results["serving"], plt, img_dir)
        written.append("serving.png")
    plt.close("all")
    return f"plots written to {img_dir}/: {', '.join(written)}" if written else "no plots for these parts"


def serving_plot(rows, plt, img_dir):
    """Rows in flight over time, static vs continuous (all requests at once, the first
    max_batch measured), and p95 TTFT vs throughput for every run."""
    rows = [r for r in rows if r["policy"] in ("static", "continuous")]  # not the fallback's comparison run
    at_once = [r for r in rows if r["arrivals"] == "all at once" and r["max_batch"] == rows[0]["max_batch"]
               and r["size"] == rows[0]["size"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.5))
    for ax, r in zip(axes[:2], at_once):
        events = sorted([(m["joined_at_s"], 1) for m in r["timeline"]]
                        + [(m["finished_at_s"], -1) for m in r["timeline"]])
        t, busy, level = [0.0], [0], 0
        for time_s, change in events:
            t += [time_s, time_s]
            busy += [level, level + change]
            level += change
        ax.fill_between(t, busy, step=None, alpha=0.6)
        ax.set(xlabel="seconds", ylabel="rows decoding", ylim=(0, r["max_batch"] + 0.5),
               title=f"{r['policy']} batching: {r['tokens_per_s']:.0f} tok/s, done in {r['seconds']:.0f} s")
    for r in rows:
        marker = "o" if r["policy"] == "continuous" else "x"
        axes[2].plot(r["tokens_per_s"], r["ttft_s_p95"], marker, label=f"{r['size']} {r['policy']} "
                     f"{r['max_batch']}, {'at once' if r['arrivals'] == 'all at once' else 'stream'}")
    axes[2].set(yscale="log", xlabel="tokens/s", ylabel="p95 time to first token, s", title="Latency vs throughput")
    axes[2].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(img_dir, "serving.png"), dpi=120)
