"""lowtail: low-tail-latency CPU inference nodes for Ray-based RL clusters."""

__version__ = "0.1.0"
