"""Kubeflow Pipelines components, one folder per stage (installed as the `rlaif_components` package)."""
