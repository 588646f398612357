"""rlaif: an RLAIF pipeline (generate -> label -> train_rm -> ppo -> evaluate) run as a workflow DAG."""

__version__ = "0.1.0"
