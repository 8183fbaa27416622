"""lowtail: low-tail-latency CPU inference nodes for Ray-based RL clusters."""

__version__ = "0.1.0"

from lowtail import renamed as _renamed

_renamed.install()  # old module names keep working for a release (lowtail.renamed)
