"""Evaluation reports: report.md, a self-contained report.html with embedded PNG plots, plots/*.png, and the
side-by-side comparison of several runs. Built from a run's files only (evaluate/metrics.json, evaluate/examples.jsonl,
ppo/metrics.jsonl), so `rlaif report RUN_DIR` can rebuild them at any time."""
from __future__ import annotations

import base64
import html
import io
import json

from rlaif.io import storage


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    _figure().close(fig)
    return buf.getvalue()


def ppo_curves(ppo_rows: list[dict]) -> bytes:
    """Reward-model score and KL to the reference over PPO iterations (also saved by the ppo stage)."""
    fig, (a, b) = _figure().subplots(1, 2, figsize=(10, 3.2))
    it = [r["iteration"] for r in ppo_rows]
    a.plot(it, [r["reward_raw"] for r in ppo_rows], color="tab:blue")
    a.set(title="PPO: reward-model score", xlabel="iteration")
    b.plot(it, [r["kl"] for r in ppo_rows], color="tab:red")
    b.set(title="PPO: KL to reference (per sequence)", xlabel="iteration")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    return _png(fig)


def plots(metrics: dict, examples: list[dict], ppo_rows: list[dict]) -> dict[str, bytes]:
    plt = _figure()
    out = {"ppo_reward_kl.png": ppo_curves(ppo_rows)} if ppo_rows else {}

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    bins = 30
    a.hist([x["reward_reference"] for x in examples], bins=bins, alpha=0.6, label="start", color="tab:gray")
    a.hist([x["reward_tuned"] for x in examples], bins=bins, alpha=0.6, label="tuned", color="tab:green")
    a.set(title="reward-model score (normalised)", xlabel="reward")
    a.legend()
    b.hist([x["length_reference"] for x in examples], bins=bins, alpha=0.6, label="start", color="tab:gray")
    b.hist([x["length_tuned"] for x in examples], bins=bins, alpha=0.6, label="tuned", color="tab:green")
    b.set(title="response length (tokens)", xlabel="tokens")
    b.legend()
    out["distributions.png"] = _png(fig)

    judges = metrics["judges"]
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.6 * len(judges)))
    names = list(judges)
    rates = [judges[n]["win_rate"] for n in names]
    lo = [judges[n]["win_rate"] - judges[n]["win_rate_ci95"][0] for n in names]
    hi = [judges[n]["win_rate_ci95"][1] - judges[n]["win_rate"] for n in names]
    ax.barh(names, rates, xerr=[lo, hi], color="tab:green", alpha=0.7, capsize=5, label="win rate (95% CI)")
    ax.scatter([judges[n]["win_rate_length_controlled"] for n in names], names, color="black", zorder=3,
               label="length-controlled")
    ax.axvline(0.5, color="tab:red", linestyle="--", linewidth=1)
    ax.set(xlim=(0, 1), title="tuned vs start: win rate by judge")
    ax.legend(loc="lower right", fontsize=8)
    out["win_rate.png"] = _png(fig)
    return out


HACKING_GAP = 0.15  # training-judge win rate this far above the reference judge's reads as reward hacking
COLLAPSE_SHARE = 0.05  # the most common tuned answer above this share of all answers reads as mode collapse


def verdicts(metrics: dict) -> list[str]:
    """What the numbers say, in words: reward hacking, mode collapse, judges that cannot tell the policies apart."""
    judges, out = metrics["judges"], []
    training, reference = judges.get("training"), judges.get("reference")
    if training and reference:
        gap = training["win_rate"] - reference["win_rate"]
        if training["win_rate_ci95"][0] > 0.5 >= reference["win_rate_ci95"][0]:
            out.append(f"Reward hacking: the training judge prefers the tuned policy ({training['win_rate']:.3f}) "
                       f"but the reference judge, which checks key points, does not ({reference['win_rate']:.3f}).")
        elif gap > HACKING_GAP:
            out.append(f"Part of the gain may be the training judge's taste: it rates the tuned policy well above the "
                       f"reference judge ({training['win_rate']:.3f} vs {reference['win_rate']:.3f}).")
        if reference["win_rate_ci95"][0] > 0.5:
            out.append(f"The improvement is real: the reference judge, which checks the prompts' key points and was "
                       f"never trained against, prefers the tuned policy ({reference['win_rate']:.3f}).")
    div = metrics.get("diversity")
    if div and div["top_response_share"] > COLLAPSE_SHARE and div["top_response_share"] * metrics["n_prompts"] >= 2:
        out.append(f"Mode collapse: {div['top_response_share']:.0%} of the tuned answers are the same text "
                   f"({div['top_response'][:80]!r}); distinct-2 {div['distinct_2']:.3f} vs "
                   f"{metrics['diversity_reference']['distinct_2']:.3f} for the starting policy.")
    for name, judge in judges.items():
        lo, hi = judge["win_rate_ci95"]
        if lo <= 0.5 <= hi:
            out.append(f"Judge '{name}' cannot tell the two policies apart: "
                       f"its interval [{lo:.3f}, {hi:.3f}] contains 0.5.")
    return out


def _summary_rows(metrics: dict) -> list[tuple[str, str]]:
    rows = []
    for name, j in metrics["judges"].items():
        lo, hi = j["win_rate_ci95"]
        rows.append((f"win rate, judge '{name}'", f"{j['win_rate']:.3f} [95% CI {lo:.3f}, {hi:.3f}]; length-controlled "
                     f"{j['win_rate_length_controlled']:.3f}; {j['wins']}/{j['ties']}/{j['losses']} W/T/L"))
    rows += [
        ("prompts (held out)", str(metrics["n_prompts"])),
        ("reward (normalised), tuned vs start",
         f"{metrics['reward_policy_mean']:.3f} vs {metrics['reward_reference_mean']:.3f}"),
        ("KL to reference (per sequence / per token)",
         f"{metrics['kl_to_reference']:.3f} / {metrics['kl_to_reference_per_token']:.4f}"),
        ("response length (tokens), tuned vs start",
         f"{metrics['length_policy_mean']:.1f} vs {metrics['length_reference_mean']:.1f}"),
    ]
    if "eos_rate_policy" in metrics:
        rows.append(("answers ending with EOS, tuned vs start",
                     f"{metrics['eos_rate_policy']:.3f} vs {metrics['eos_rate_reference']:.3f}"))
    if "diversity" in metrics:
        tuned, start = metrics["diversity"], metrics["diversity_reference"]
        rows.append(("most common answer's share / distinct-2, tuned vs start",
                     f"{tuned['top_response_share']:.3f} / {tuned['distinct_2']:.3f} vs "
                     f"{start['top_response_share']:.3f} / {start['distinct_2']:.3f}"))
    upstream = metrics.get("upstream", {})
    if upstream.get("label_reference_agreement") is not None:
        rows.append(("AI labeler's agreement with the reference judge (clear pairs)",
                     f"{upstream['label_reference_agreement']:.3f}"))
    if upstream.get("rm_held_out_accuracy") is not None:
        against = upstream.get("rm_held_out_reference_accuracy")
        rows.append(("reward model held-out accuracy: AI labels / reference judge",
                     f"{upstream['rm_held_out_accuracy']:.3f} / " + ("-" if against is None else f"{against:.3f}")))
    gates = metrics.get("gates", {})
    if gates.get("checked"):
        rows.append(("quality gates", "passed" if gates["passed"] else "FAILED: " + "; ".join(gates["failures"])))
    return rows


def render_markdown(run_id: str, metrics: dict, examples: list[dict]) -> str:
    lines = [f"# rlaif report: run `{run_id}`", "", *[f"> {v}" for v in verdicts(metrics)], "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _summary_rows(metrics)]
    lines += ["", "Plots: `plots/` beside this file (and embedded in report.html).", "", "## Examples", ""]
    for x in examples:
        lines += [f"**Prompt:** {x['prompt']}", "", f"- tuned: {x['tuned']}", f"- start: {x['reference']}",
                  "- P(tuned better): " + ", ".join(f"{k} {v:.2f}" for k, v in x["p_tuned_better"].items()), ""]
    return "\n".join(lines)


_STYLE = ("body{font-family:system-ui,-apple-system,sans-serif;max-width:1040px;margin:2em auto;color:#222;"
          "padding:0 1em}\n"
          "table{border-collapse:collapse;width:100%;margin:1em 0}"
          "th,td{border:1px solid #ddd;padding:6px 8px;text-align:left;vertical-align:top}\n"
          "th{background:#f5f5f5}img{max-width:100%;margin:.5em 0}.pass{color:#1a7f37}"
          ".fail{color:#cf222e;font-weight:bold}")


def render_html(run_id: str, metrics: dict, examples: list[dict], pngs: dict[str, bytes]) -> str:
    esc = html.escape
    table = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _summary_rows(metrics))
    images = "".join(f'<img alt="{esc(name)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
                     for name, png in pngs.items())
    judge_names = list(metrics["judges"])
    head = "".join(f"<th>P(tuned better): {esc(n)}</th>" for n in judge_names)
    rows = "".join(
        f"<tr><td>{esc(x['prompt'])}</td><td>{esc(x['tuned'])}</td><td>{esc(x['reference'])}</td>"
        + "".join(f"<td>{x['p_tuned_better'][n]:.2f}</td>" for n in judge_names) + "</tr>"
        for x in examples
    )
    gates = metrics.get("gates", {})
    banner = "".join(f"<p><b>{esc(v)}</b></p>" for v in verdicts(metrics))
    if gates.get("checked"):
        banner += ('<p class="pass">Quality gates passed.</p>' if gates["passed"]
                  else f'<p class="fail">Quality gates FAILED: {esc("; ".join(gates["failures"]))}</p>')
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>rlaif report: {esc(run_id)}</title>'
            f"<style>{_STYLE}</style></head><body><h1>rlaif report: run <code>{esc(run_id)}</code></h1>{banner}"
            f"<table>{table}</table>{images}<h2>Examples</h2><table><tr><th>prompt</th><th>tuned</th><th>start</th>{head}</tr>"
            f"{rows}</table></body></html>")


def _read_json(url: str, lines: bool = False):
    """A run file the report is built from; a corrupt one is a one-line error, not a traceback."""
    from rlaif.errors import UserError

    try:
        text = storage.read_text(url)
        return [json.loads(line) for line in text.splitlines() if line.strip()] if lines else json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{url} is corrupt (not UTF-8 JSON): re-run the stage that wrote it") from None


def _read_jsonl(url: str) -> list[dict]:
    return _read_json(url, lines=True) if storage.exists(url) else []


def load(run_url: str) -> tuple[dict, list[dict], list[dict]]:
    from rlaif.errors import UserError

    metrics_url = storage.join(run_url, "evaluate", "metrics.json")
    if not storage.exists(metrics_url):
        raise UserError(f"{metrics_url} not found: is {run_url} a run directory whose evaluate stage has run?")
    metrics = _read_json(metrics_url)
    if not isinstance(metrics, dict) or not isinstance(metrics.get("judges"), dict):
        raise UserError(f"{metrics_url} is not an evaluation's metrics: re-run stage 'evaluate'")
    return (metrics, _read_jsonl(storage.join(run_url, "evaluate", "examples.jsonl")),
            _read_jsonl(storage.join(run_url, "ppo", "metrics.jsonl")))


def write(run_url: str, n_examples: int = 8) -> str:
    """(Re)build report.md, report.html and plots/ under <run>/evaluate/; returns the report.html URL."""
    metrics, examples, ppo_rows = load(run_url)
    run_id = run_url.rstrip("/").rsplit("/", 1)[-1]
    pngs = plots(metrics, examples, ppo_rows)
    stage = storage.join(run_url, "evaluate")
    for name, png in pngs.items():
        storage.write_bytes_atomic(storage.join(stage, "plots", name), png)
    storage.write_bytes_atomic(storage.join(stage, "report.md"),
                               render_markdown(run_id, metrics, examples[:n_examples]).encode())
    storage.write_bytes_atomic(storage.join(stage, "report.html"),
                               render_html(run_id, metrics, examples[:n_examples], pngs).encode())
    return storage.join(stage, "report.html")


COMPARE_KEYS = [("win_rate", "{:.3f}"), ("win_rate_length_controlled", "{:.3f}"), ("reward_policy_mean", "{:.3f}"),
                ("reward_reference_mean", "{:.3f}"), ("kl_to_reference", "{:.3f}"), ("length_policy_mean", "{:.1f}"),
                ("n_prompts", "{}")]


def compare(run_urls: list[str]) -> tuple[str, str]:
    """A side-by-side table of several runs' headline metrics, as Markdown and as HTML."""
    runs = [(url.rstrip("/").rsplit("/", 1)[-1], load(url)[0]) for url in run_urls]
    header = ["metric", *[name for name, _ in runs]]
    body = []
    for key, fmt in COMPARE_KEYS:
        body.append([key, *[fmt.format(m[key]) if m.get(key) is not None else "-" for _, m in runs]])
    for judge in dict.fromkeys(j for _, m in runs for j in m.get("judges", {})):
        body.append([f"win rate, judge '{judge}'",
                     *[f"{m['judges'][judge]['win_rate']:.3f}" if judge in m.get("judges", {}) else "-"
                       for _, m in runs]])
    md = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                   + ["| " + " | ".join(r) + " |" for r in body])
    esc = html.escape
    rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in body)
    page = (f'<!doctype html><html><head><meta charset="utf-8"><title>rlaif: run comparison</title>'
            f"<style>{_STYLE}</style>"
            f"</head><body><h1>rlaif: run comparison</h1>"
            f"<table><tr>{''.join(f'<th>{esc(h)}</th>' for h in header)}</tr>"
            f"{rows}"
            "</table></body></html>")
    return md, page
