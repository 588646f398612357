"""The `train_rm` component: its interface against rlaif/graph.py, its compiled YAML and its README (tables and
recipe). Fast: nothing here runs a stage."""
from rlaif_components.checks import ComponentContract


class TestTrainRMComponent(ComponentContract):
    NAME = "train_rm"
    OUTPUTS = {"manifest": "system.Artifact", "reward_model": "system.Model", "metrics": "system.Metrics"}
