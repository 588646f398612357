"""The run report as report.md and a self-contained report.html (plots embedded), both from the same blocks, and the
side-by-side comparison of several runs. Built from a run's files only, so `rlaif report RUN_DIR` rebuilds it."""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass

from rlaif.io import storage
from rlaif.report import sections, upstream
from rlaif.report.examples import Pick, choose
from rlaif.report.plots import plots
from rlaif.report.run import NA, Run, dig, load_run, num, stale_notes
from rlaif.report.sections import Block, short
from rlaif.report.verdicts import verdicts

DEFAULT_EXAMPLES = 8


@dataclass
class Page:
    run_id: str
    verdicts: list[str]
    gates: dict
    before: list[Block]  # the blocks above the examples
    picks: list[Pick]
    notes: list[str]  # on the examples
    judges: list[str]
    after: list[Block]  # the blocks below the examples


def build(run: Run, n_examples: int, evaluate_seconds: float | None = None) -> Page:
    picks, notes = choose(run.examples, n_examples)
    before = [sections.summary(run.metrics), sections.provenance(run), upstream.labeling(run),
              upstream.reward_model(run), upstream.ppo_diagnostics(run)]
    # Rebuilt later (not by the evaluate stage, which writes it before its manifest): say where it is out of date.
    stale = stale_notes(run) if evaluate_seconds is None else []
    return Page(run.run_id, [*stale, *verdicts(run.metrics)], run.metrics.get("gates") or {}, before, picks, notes,
                list(run.metrics["judges"]), [sections.stage_times(run, evaluate_seconds)])


def _md_cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def _md_block(block: Block, pngs: dict[str, bytes]) -> list[str]:
    lines = [f"## {block.title}", ""] if block.title else []
    lines += ["| " + " | ".join(block.header) + " |", "|" + "---|" * len(block.header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
    lines += ["", *([f"_{block.note}_", ""] if block.note else [])]
    lines += [f"![{name}](plots/{name})" for name in block.images if name in pngs]
    return lines + ([""] if any(name in pngs for name in block.images) else [])


def _p_values(example: dict, judges: list[str]) -> list[str]:
    p = example.get("p_tuned_better") or {}
    return [num(p.get(name), ".2f") for name in judges]


def _md_examples(page: Page) -> list[str]:
    lines = ["## Examples", "", *[f"_{note}_" for note in page.notes], *([""] if page.notes else [])]
    for k, pick in enumerate(page.picks, 1):
        x = pick.example
        p = ", ".join(f"{name} {v}" for name, v in zip(page.judges, _p_values(x, page.judges)))
        lines += [f"### {k}. {pick.why}", "", f"**Prompt:** {x.get('prompt', NA)}", "",
                  f"- tuned: {x.get('tuned', NA)}", f"- start: {x.get('reference', NA)}",
                  f"- reward: tuned {num(x.get('reward_tuned'))}, start {num(x.get('reward_reference'))}",
                  f"- P(tuned better): {p}", ""]
    return lines


def render_markdown(page: Page, pngs: dict[str, bytes]) -> str:
    lines = [f"# rlaif report: run `{page.run_id}`", "", *[f"> {v}" for v in page.verdicts], ""]
    for block in page.before:
        lines += _md_block(block, pngs)
    lines += _md_examples(page)
    for block in page.after:
        lines += _md_block(block, pngs)
    return "\n".join(lines)


_STYLE = ("body{font-family:system-ui,-apple-system,sans-serif;max-width:1040px;margin:2em auto;color:#222;"
          "padding:0 1em}\n"
          "table{border-collapse:collapse;width:100%;margin:1em 0}"
          "th,td{border:1px solid #ddd;padding:6px 8px;text-align:left;vertical-align:top}\n"
          "th{background:#f5f5f5}img{max-width:100%;margin:.5em 0}.pass{color:#1a7f37}"
          ".fail{color:#cf222e;font-weight:bold}.note{color:#555;font-size:.9em}.why{font-weight:bold}")


def _img(name: str, png: bytes) -> str:
    return f'<img alt="{html.escape(name)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _html_block(block: Block, pngs: dict[str, bytes]) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in block.header)
    rows = "".join("<tr>" + "".join((f"<th>{esc(c)}</th>" if block.keyed and j == 0 else f"<td>{esc(c)}</td>")
                                    for j, c in enumerate(row)) + "</tr>" for row in block.rows)
    return ((f"<h2>{esc(block.title)}</h2>" if block.title else "")
            + (f"<table><tr>{head}</tr>" if not block.keyed else "<table>") + f"{rows}</table>"
            + (f'<p class="note">{esc(block.note)}</p>' if block.note else "")
            + "".join(_img(name, pngs[name]) for name in block.images if name in pngs))


def _html_examples(page: Page) -> str:
    esc = html.escape
    head = "".join(f"<th>P(tuned better): {esc(n)}</th>" for n in page.judges)
    rows = "".join(
        f'<tr><td class="why">{esc(pick.why)}</td><td>{esc(str(pick.example.get("prompt", NA)))}</td>'
        f"<td>{esc(str(pick.example.get('tuned', NA)))}</td><td>{esc(str(pick.example.get('reference', NA)))}</td>"
        f"<td>{num(pick.example.get('reward_tuned'))} / {num(pick.example.get('reward_reference'))}</td>"
        + "".join(f"<td>{v}</td>" for v in _p_values(pick.example, page.judges)) + "</tr>"
        for pick in page.picks)
    notes = "".join(f'<p class="note">{esc(note)}</p>' for note in page.notes)
    return (f"<h2>Examples</h2>{notes}<table><tr><th>why chosen</th><th>prompt</th><th>tuned</th><th>start</th>"
            f"<th>reward: tuned / start</th>{head}</tr>{rows}</table>")


def render_html(page: Page, pngs: dict[str, bytes]) -> str:
    esc = html.escape
    banner = "".join(f"<p><b>{esc(v)}</b></p>" for v in page.verdicts)
    if page.gates.get("checked"):
        banner += ('<p class="pass">Quality gates passed.</p>' if page.gates.get("passed")
                   else f'<p class="fail">Quality gates FAILED: {esc("; ".join(page.gates.get("failures", [])))}</p>')
    body = ("".join(_html_block(b, pngs) for b in page.before) + _html_examples(page)
            + "".join(_html_block(b, pngs) for b in page.after))
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>rlaif report: {esc(page.run_id)}</title>'
            f"<style>{_STYLE}</style></head><body><h1>rlaif report: run <code>{esc(page.run_id)}</code></h1>"
            f"{banner}{body}</body></html>")


def write(run_url: str, n_examples: int | None = None, evaluate_seconds: float | None = None) -> str:
    """(Re)build report.md, report.html and plots/ under <run>/evaluate/; returns the report.html URL. n_examples
    defaults to the run config's evaluate.n_examples; the evaluate stage, whose manifest comes after its report,
    passes its own time so far (and its files are checked against a manifest only once it has one)."""
    run = load_run(run_url, verify=evaluate_seconds is None)
    if n_examples is None:
        configured = dig(run.config, "evaluate", "n_examples")
        n_examples = configured if isinstance(configured, int) and configured >= 0 else DEFAULT_EXAMPLES
    page = build(run, n_examples, evaluate_seconds)
    pngs = plots(run.metrics, run.examples, run.ppo_rows)
    stage = storage.join(run_url, "evaluate")
    for name, png in pngs.items():
        storage.write_bytes_atomic(storage.join(stage, "plots", name), png)
    storage.write_bytes_atomic(storage.join(stage, "report.md"), render_markdown(page, pngs).encode())
    storage.write_bytes_atomic(storage.join(stage, "report.html"), render_html(page, pngs).encode())
    return storage.join(stage, "report.html")


COMPARE_KEYS = [("win_rate", "{:.3f}"), ("win_rate_length_controlled", "{:.3f}"), ("reward_policy_mean", "{:.3f}"),
                ("reward_reference_mean", "{:.3f}"), ("kl_to_reference", "{:.3f}"), ("length_policy_mean", "{:.1f}"),
                ("n_prompts", "{}")]


def column_names(run_urls: list[str]) -> list[str]:
    """Each run's column heading: its directory's name, or as much of its path as tells runs of one name apart."""
    paths = [url.rstrip("/").split("/") for url in run_urls]
    depth = 1
    while depth < max(map(len, paths)) and len({"/".join(p[-depth:]) for p in paths}) < len(paths):
        depth += 1
    return ["/".join(p[-depth:]) for p in paths]


def _shown(value, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _gates(gates) -> str:
    if not isinstance(gates, dict) or not gates.get("checked"):
        return "not set"
    return "passed" if gates.get("passed") else "FAILED: " + "; ".join(map(str, gates.get("failures", [])))


def _evaluation(run: Run) -> str:
    if run.manifests.get("evaluate") is not None:
        return "committed" + (" ⚠ out of date: see the notes below" if run.lineage.notes() else "")
    if "evaluate" in run.problems:
        return f"unverified: its manifest {run.problems['evaluate'][0]}"
    return "not committed (no evaluate manifest: unfinished, earlier or gate-failed; unverified)"


def _judge_identity(run: Run, name: str) -> tuple | None:
    """Judge `name` of a run as its evaluation recorded it: its name (`hf:<directory>`, which two models can share)
    and the digests of its model and constitution files; None where the run has no such judge or names none."""
    recorded = dig(run.metrics, "judges", name, "judge")
    if recorded is None:
        return None
    inputs = dig(run.manifests.get("evaluate"), "inputs") or {}
    files = f"file:{'label' if name == 'training' else f'evaluate.{name}'}"  # the training judge is label's
    return recorded, inputs.get(f"{files}.model"), inputs.get(f"{files}.constitution")


def _judges_differ(runs: list[Run], name: str) -> bool:
    """Does judge `name` stand for different judges in different runs (the training judge is each run's labeling
    judge)? Their win rates are then not comparable."""
    return len({identity for run in runs if (identity := _judge_identity(run, name)) is not None}) > 1


def _judge_shown(run: Run, name: str) -> str:
    identity = _judge_identity(run, name)
    if identity is None:
        return NA
    recorded, model, constitution = identity
    files = [f"{what} {short(digest)}" for what, digest in (("model", model), ("constitution", constitution))
             if digest]
    return f"{recorded}{'; ' + ', '.join(files) if files else ''}"


def _judge_rows(runs: list[Run]) -> list[list[str]]:
    """Each judge's win rate per run; a judge name that stands for different judges is marked on its row, with each
    run's judge and the digests of its files."""
    rows = []
    for name in dict.fromkeys(j for run in runs for j in run.metrics["judges"]):
        differ = _judges_differ(runs, name)
        heading = f"win rate, judge '{name}'" + (" ⚠ a different judge per run: not comparable" if differ else "")
        rows.append([heading, *[_shown(dig(run.metrics, "judges", name, "win_rate"), "{:.3f}")
                                + (f" ({_judge_shown(run, name)})" if differ else "")
                                for run in runs]])
    return rows


def compare(run_urls: list[str]) -> tuple[str, str]:
    """A side-by-side table of several runs' headline metrics and provenance, as Markdown and as HTML, with each
    run's notes where its results are not its current state (the notes a run's own report opens with)."""
    runs = [load_run(url, details=False) for url in run_urls]
    notes = [stale_notes(run) for run in runs]
    header = ["metric", *column_names(run_urls)]
    body = [["evaluation", *[_evaluation(run) for run in runs]],
            ["quality gates", *[_gates(run.metrics.get("gates")) for run in runs]]]
    differ = " ⚠ the training judges differ: not comparable" if _judges_differ(runs, "training") else ""
    for key, fmt in COMPARE_KEYS:
        mark = differ if key.startswith("win_rate") else ""  # the training judge's rates
        body.append([key + mark, *[_shown(run.metrics.get(key), fmt) for run in runs]])
    body += _judge_rows(runs)
    provenance = [sections.provenance(run).rows for run in runs]
    body += [[row[0], *[rows[i][1] for rows in provenance]] for i, row in enumerate(provenance[0])]
    named = [(name, note) for name, run_notes in zip(header[1:], notes) for note in run_notes]
    md = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                   + ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in body]
                   + (["", "## Notes", ""] + [f"- **{name}**: {note}" for name, note in named] if named else []))
    esc = html.escape
    rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in body)
    listed = "".join(f"<li><b>{esc(name)}</b>: {esc(note)}</li>" for name, note in named)
    page = (f'<!doctype html><html><head><meta charset="utf-8"><title>rlaif: run comparison</title>'
            f"<style>{_STYLE}</style>"
            f"</head><body><h1>rlaif: run comparison</h1>"
            f"<table><tr>{''.join(f'<th>{esc(h)}</th>' for h in header)}</tr>"
            f"{rows}</table>" + (f"<h2>Notes</h2><ul>{listed}</ul>" if named else "") + "</body></html>")
    return md, page
