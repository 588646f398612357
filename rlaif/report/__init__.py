"""Evaluation reports: <run>/evaluate/report.md, a self-contained report.html with embedded PNG plots, plots/*.png,
and the side-by-side comparison of several runs. Built from a run's files only (stage manifests, config.yaml,
label/metrics.json, ppo/metrics.jsonl, evaluate/metrics.json and examples.jsonl), so `rlaif report RUN_DIR` rebuilds
them at any time, and a file an older run lacks shows as "n/a".

  run.py       loading a run directory (metrics.json's shape checked once), and the "n/a"-tolerant formatting
  lineage.py   which outputs and config.yaml settings now are not the ones the results were made from
  verdicts.py  what the numbers say, in words
  sections.py  the headline table, provenance (models, judges, settings, code and config digests), stage times
  upstream.py  labeling statistics, reward-model quality, PPO diagnostics
  examples.py  examples chosen to teach: judge disagreements, biggest reward gains and losses
  plots.py     the figures
  page.py      report.md and report.html from the blocks; `write` and `compare`
"""
from rlaif.report.page import compare, write
from rlaif.report.plots import plots, ppo_curves
from rlaif.report.verdicts import verdicts

__all__ = ["compare", "plots", "ppo_curves", "verdicts", "write"]
