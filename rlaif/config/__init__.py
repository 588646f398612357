"""Pipeline configuration: one pydantic model per stage (`stages.py`, `ppo.py`), the data and storage settings
(`data.py`), the judges' settings (`judges.py`), and loading YAML with overrides (`loading.py`). Import from here:
`from rlaif.config import PipelineConfig, load_config`."""
from rlaif.config.base import Strict, cache_key_dump, no_credentials, runtime_field
from rlaif.config.data import DataConfig, PromptColumns, StorageConfig
from rlaif.config.judges import (
    DEFAULT_PREAMBLE,
    DEFAULT_RUDE_TERMS,
    HFJudgeConfig,
    JudgeSettings,
    JudgeSpec,
    OpenAIJudgeConfig,
    ReferenceJudgeConfig,
    RulesJudgeConfig,
)
from rlaif.config.loading import (
    UniqueKeyLoader,
    apply_overrides,
    check_switches,
    config_fields,
    dump_config,
    load_config,
    load_yaml,
    parse_config,
    possible_switches,
    safe_run_id,
    sha256_json,
    stage_config_hash,
)
from rlaif.config.ppo import PPOConfig
from rlaif.config.serving import ServeConfig, ServiceEndpoint
from rlaif.config.stages import (
    EvaluateConfig,
    GenerateConfig,
    LabelConfig,
    PipelineConfig,
    PolicyConfig,
    TinyPolicyConfig,
    TrackingConfig,
    TrainRMConfig,
)

__all__ = [
    "DEFAULT_PREAMBLE", "DEFAULT_RUDE_TERMS", "DataConfig", "EvaluateConfig", "GenerateConfig", "HFJudgeConfig",
    "JudgeSettings", "JudgeSpec", "LabelConfig", "OpenAIJudgeConfig", "PPOConfig", "PipelineConfig", "PolicyConfig",
    "PromptColumns", "ReferenceJudgeConfig", "RulesJudgeConfig",
    "ServeConfig", "ServiceEndpoint", "StorageConfig", "Strict", "TinyPolicyConfig",
    "TrackingConfig",
    "TrainRMConfig",
    "UniqueKeyLoader", "apply_overrides", "cache_key_dump", "check_switches", "runtime_field",
    "config_fields", "dump_config", "load_config", "load_yaml", "no_credentials",
    "parse_config", "possible_switches", "safe_run_id", "sha256_json", "stage_config_hash",
]
