"""The serving engine: requests, the scheduler over paged KV blocks with prefix caching, and the host
loop that runs the decode step and the prompt chunks (see engine.py); offline generation over it
(offline.py)."""
from dspark.engine.engine import Engine, EngineStopped
from dspark.engine.offline import generate
from dspark.engine.request import Request
from dspark.engine.stats import EngineStats, Histogram

__all__ = ["Engine", "EngineStats", "EngineStopped", "Histogram", "Request", "generate"]
