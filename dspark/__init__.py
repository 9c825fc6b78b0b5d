"""dspark: DSpark speculative decoding in PyTorch, Triton and torch.compile."""
from dspark.checkpoint import load_drafter, save_drafter
from dspark.config import DrafterConfig, TargetConfig
from dspark.decoder import SpeculativeDecoder
from dspark.drafter import DSparkDrafter
from dspark.loading import load_default, load_target
from dspark.output import GenerationResult
from dspark.sampling import SamplingParams
from dspark.target import TargetModel

__version__ = "0.1.0"  # pyproject.toml reads it

__all__ = ["DSparkDrafter", "DrafterConfig", "GenerationResult", "SamplingParams", "SpeculativeDecoder",
           "TargetConfig", "TargetModel", "load_default", "load_drafter", "load_target", "save_drafter"]
