"""The `evaluate` component: its interface against rlaif/graph.py, its compiled YAML and its README (tables and
recipe). Fast: nothing here runs a stage."""
from rlaif_components.checks import ComponentContract


class TestEvaluateComponent(ComponentContract):
    NAME = "evaluate"
    OUTPUTS = {"manifest": "system.Artifact", "metrics": "system.Metrics", "report": "system.HTML",
               "report_markdown": "system.Markdown"}
