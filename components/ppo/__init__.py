from rlaif_components.ppo.component import ppo

__all__ = ["ppo"]
