"""dipaco: train modular language models the DiPaCo way.

Pipeline: ``dipaco.sharding`` (route a corpus into path shards) -> ``dipaco.training.train`` (path workers with
DiLoCo-style module averaging) -> ``dipaco.eval`` (routed perplexity, generation, export).
"""

from dipaco.errors import DipacoError

__version__ = "0.1.0"
__all__ = ["DipacoError", "__version__"]
