from rlaif_components.generate.component import generate

__all__ = ["generate"]
