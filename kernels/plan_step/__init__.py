from .naive import naive_plan_step
from .triton import plan_step

__all__ = ["naive_plan_step", "plan_step"]
