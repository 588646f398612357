from rlaif_components.train_rm.component import train_rm

__all__ = ["train_rm"]
