"""The engine moved to dspark.engine; the HTTP layer's imports follow it when its rewrite lands."""
from dspark.engine import Engine, EngineStats, EngineStopped, Histogram, Request  # noqa: F401
