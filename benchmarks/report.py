"""Turn a bench run's results into a Markdown report and PNG plots.

`markdown(results)` puts the machine first, then one table per scenario, and
the comparison table (every ratio, every target, met or missed by how much)
last. `plots(results, out_dir)` draws, per scenario, output tokens/s and the
TTFT/TPOT percentiles of each configuration.
"""

from __future__ import annotations

from pathlib import Path

# Issue #17: decode at batch 64 runs at >= 80% of the measured GEMM peak (model FLOPs per step time).
DECODE_MFU_TARGET = 0.8


def _num(value, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    return "–" if value is None else fmt.format(value * scale)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "/").replace("\n", " ")


def machine_section(machine: dict | None) -> list[str]:
    if not machine:
        return []
    m = machine["machine"]
    lines = ["## Machine", "",
             f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
             f"Python {m['python']}; load average at the start {_load(m.get('load_average'))}.", "",
             f"- float32 GEMM: **{machine['gemm_gflops']:.1f} GFLOP/s**"
             + (" (" + ", ".join(f"{k} {v:.1f}" for k, v in machine["gemm_kernels"].items()) + ")"
                if machine.get("gemm_kernels") else ""),
             f"- decode at batch {machine['decode']['batch']} ({Path(machine['model_dir']).name}): "
             f"{machine['decode']['step_ms']:.1f} ms/step, {machine['decode']['achieved_gflops']:.1f} GFLOP/s, "
             f"MFU **{machine['decode']['mfu']:.1%}** (model time only: {machine['decode']['mfu_model_only']:.1%})"
             + _mfu_rounds(machine), "",
             "| batch | step ms | model ms | outside the model |", "|---:|---:|---:|---:|"]
    for batch, row in machine["overhead"].items():
        lines.append(f"| {batch} | {row['step_ms']:.1f} | {row['model_ms']:.1f} | {row['fraction']:.1%} |")
    return lines + [""]


def _mfu_rounds(machine: dict) -> str:
    """The MFU of each round against its own round's GEMM peak, when there were several."""
    by_round = machine["decode"].get("mfu_rounds") or []
    if len(by_round) < 2:
        return ""
    return (f"; {len(by_round)} rounds in turn, the best of each side above; each round against its own GEMM "
            f"peak: {', '.join(f'{x:.1%}' for x in by_round)}")


def _load(load) -> str:
    return "unknown" if not load else " / ".join(f"{x:.1f}" for x in load)


def scenario_section(summary: dict, peak_gflops: float | None = None) -> list[str]:
    """A scenario's table; with the machine's float32 GEMM peak (float32 runs only),
    each run's useful GFLOP/s (benchmarks/work.py) also as a fraction of it."""
    lines = [f"## {summary['scenario']}", ""]
    if summary.get("status") != "ok":
        return lines + [summary.get("status", "not run"), ""]
    if summary.get("note"):
        lines += [summary["note"], ""]
    if summary.get("model_dir"):
        why = summary.get("model_reason", "the default one holds too few positions")
        lines += [f"Model of this scenario: `{Path(summary['model_dir']).name}` ({why}).", ""]
    cls = summary.get("latency_class")
    if cls:
        lines += [f"TTFT and TPOT of the `{cls}` requests only.", ""]
    work = "useful GFLOP/s" + (" (of the GEMM peak)" if peak_gflops else "")
    lines += ["| configuration | status | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
              f"| peak KV MiB | {work} |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in summary["runs"]:
        m = run.get("metrics")
        if m is None:
            lines.append(f"| {run['label']} | {_cell(run['status'])} | | | | | | | |")
            continue
        lines.append(f"| {run['label']} | ok | {_num(m['tokens_per_s'])} | {_num(m['ttft_p50_s'], scale=1e3)} "
                     f"| {_num(m['ttft_p99_s'], scale=1e3)} | {_num(m['tpot_p50_s'], '{:.2f}', 1e3)} "
                     f"| {_num(m['tpot_p99_s'], '{:.2f}', 1e3)} | {_num(m['peak_kv_mib'])} "
                     f"| {_useful(m.get('useful_gflops'), peak_gflops)} |")
    lines.append("")
    if summary.get("same_output"):
        lines += [same_output_line(summary["same_output"]), ""]
    if summary.get("prefill_attention"):
        from .prefill_attention import markdown as prefill_markdown

        lines += prefill_markdown(summary["prefill_attention"])
    if summary.get("batch1"):
        from .batch1 import markdown as batch1_markdown

        lines += batch1_markdown(summary["batch1"])
    if summary.get("structured"):
        from .structured import markdown as structured_markdown

        lines += structured_markdown(summary["structured"])
    return lines


def same_output_line(row: dict) -> str:
    """The scenario's greedy-output check between two of its runs, in a sentence."""
    first, second = row["runs"]
    if row["status"] == "identical":
        return f"Greedy output of {first} and {second}: identical on all {row['requests']} requests."
    if row["status"] == "differ":
        shown = ", ".join(row["differing"][:5]) + (", ..." if len(row["differing"]) > 5 else "")
        return (f"Greedy output of {first} and {second}: differs on {len(row['differing'])} of {row['requests']} "
                f"requests ({shown}).")
    return f"Greedy output of {first} and {second}: {row['status']}."


def _useful(gflops: float | None, peak: float | None) -> str:
    if gflops is None or not peak:
        return _num(gflops)
    return f"{gflops:.1f} ({gflops / peak:.0%})"


def comparison_section(results: dict) -> list[str]:
    """Every ratio of a scenario's subject against its peers, then every target."""
    lines = ["## Comparison", "", "| scenario | subject | against | throughput × | per CPU second × | TTFT p50 × "
             "| throughput × round by round |", "|---|---|---|---:|---:|---:|---|"]
    for summary in results["scenarios"]:
        for other, r in summary.get("ratios", {}).items():
            by_round = ", ".join(_num(x, "{:.2f}") for x in r.get("throughput_rounds", []))
            lines.append(f"| {summary['scenario']} | {summary['subject']} | {other} | {_num(r['throughput'], '{:.2f}')} "
                         f"| {_num(r.get('throughput_cpu'), '{:.2f}')} | {_num(r['ttft_p50'], '{:.3g}')} | {by_round} |")
        for run in summary.get("runs", []):
            if run["status"] != "ok":
                lines.append(f"| {summary['scenario']} | {summary['subject']} | {run['label']} "
                             f"| {_cell(run['status'])} | | | |")
        if summary.get("status") != "ok":
            lines.append(f"| {summary['scenario']} | | | {summary.get('status')} | | | |")
    lines += ["", "| target | measured | status |", "|---|---:|---|"]
    for row in all_targets(results):
        lines.append(f"| {row['target']} | {_value(row)} | {_status(row)} |")
    return lines + [""]


def all_targets(results: dict) -> list[dict]:
    rows = [t for s in results["scenarios"] for t in s.get("targets", [])]
    machine = results.get("machine")
    if machine:
        mfu = machine["decode"]["mfu"]
        rows.append({"target": f"decode MFU >= {DECODE_MFU_TARGET:.0%} at batch 64", "metric": "fraction", "value": mfu,
                     "threshold": DECODE_MFU_TARGET, "status": "met" if mfu >= DECODE_MFU_TARGET else "missed"})
        over = machine["overhead"].get("32")
        if over is not None:
            # lower is better: "met" when at or under the threshold
            rows.append({"target": "engine overhead <= 10% of step time at batch 32", "metric": "overhead",
                         "value": over["fraction"], "threshold": 0.10,
                         "status": "met" if over["fraction"] <= 0.10 else "missed"})
    return rows


def _value(row: dict) -> str:
    if row["value"] is None:
        return "–"
    return f"{row['value']:.2f}×" if row["metric"] == "throughput" else f"{row['value']:.1%}"


def _status(row: dict) -> str:
    if row["status"] != "missed":
        return row["status"]
    if row["metric"] == "throughput":
        return f"missed: {row['value'] / row['threshold']:.0%} of the target"
    if row["metric"] == "overhead":
        return f"missed by {row['value'] - row['threshold']:.1%} points"
    return f"missed by {row['threshold'] - row['value']:.1%} points"


def markdown(results: dict) -> str:
    """The whole report; the comparison table comes last."""
    head = ["# kvforge bench", "", f"Command: `{results['command']}`", "",
            f"Model: `{results['model']}` ({results['dtype']}); {'quick' if results['quick'] else 'full'} sizes; "
            f"{results.get('threads') or 'default'} thread(s) per engine; each configuration the fastest of "
            f"{results.get('repeats', 1)} round(s), the configurations in turn"
            + (f"; only the first {results['max_requests']} requests of each workload." if results.get("max_requests")
               else "."), ""]
    # a peer mapped to None was turned off (--peer NAME=none)
    peers_line = ", ".join(f"{k}={v}" for k, v in results["peers"].items() if k != "kvforge" and v)
    head += [f"Peers: {peers_line}." if peers_line else
             "Peers: none (`--peer NAME=PATH/TO/python` runs one); only kvforge configurations ran.", ""]
    if results.get("allocator_note"):
        head += [results["allocator_note"], ""]
    machine = results.get("machine")
    # the peak is float32's: other dtypes' runs get no fraction of it
    peak = machine["gemm_gflops"] if machine and results.get("dtype", "float32") == "float32" else None
    body = machine_section(machine)
    for summary in results["scenarios"]:
        body += scenario_section(summary, peak)
    return "\n".join(head + body + comparison_section(results))


def plots(results: dict, out_dir: Path) -> list[Path]:
    """One PNG per scenario that ran: throughput bars beside latency bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for summary in results["scenarios"]:
        runs = [r for r in summary.get("runs", []) if r.get("metrics")]
        if not runs:
            continue
        labels = [r["label"] for r in runs]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.barh(labels, [r["metrics"]["tokens_per_s"] or 0 for r in runs], color="tab:blue")
        left.set_xlabel("output tokens/s")
        left.set_title(f"{summary['scenario']}: throughput")
        keys = [("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("tpot_p50_s", "TPOT p50"),
                ("tpot_p99_s", "TPOT p99")]
        width = 0.8 / len(runs)
        for i, run in enumerate(runs):
            values = [(run["metrics"][k] or 0) * 1e3 for k, _ in keys]
            right.bar([j + i * width for j in range(len(keys))], values, width, label=run["label"])
        right.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))], [name for _, name in keys])
        right.set_ylabel("ms")
        right.set_yscale("log")
        right.set_title("latency" + (f" ({summary['latency_class']} requests)" if summary.get("latency_class") else ""))
        right.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out_dir) / f"{summary['scenario']}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
