"""Run configuration: dataclass schema (schema.py), building from composed YAML (build.py),
cross-field validation before any worker starts (validate.py), and Hydra composition (load.py)."""

from rlframe.config.build import build_config, to_dict
from rlframe.config.load import load_config
from rlframe.config.schema import RunConfig
from rlframe.config.validate import ConfigError, validate

__all__ = ["ConfigError", "RunConfig", "build_config", "load_config", "to_dict", "validate"]
