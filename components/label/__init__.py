from rlaif_components.label.component import label

__all__ = ["label"]
