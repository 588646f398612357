"""The `ppo` component: its interface against rlaif/graph.py, its compiled YAML and its README (tables and
recipe). Fast: nothing here runs a stage."""
from rlaif_components.checks import ComponentContract


class TestPPOComponent(ComponentContract):
    NAME = "ppo"
    OUTPUTS = {"manifest": "system.Artifact", "policy": "system.Model", "metrics": "system.Metrics"}
