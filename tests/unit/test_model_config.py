"""model_config: a model directory's config as the launcher's checks read it, from config.json without transformers,
agreeing with AutoConfig on what those checks use."""
import json

import pytest
from transformers import (
    AutoConfig,
    BertConfig,
    DebertaV2Config,
    GPT2Config,
    LlamaConfig,
    RobertaConfig,
    XLMRobertaConfig,
)

from rlaif.errors import UserError
from rlaif.models.loading import (
    check_backbone_fits,
    config_layers,
    config_position_limit,
    encoder_position_limit,
    model_config,
)


def same_answers(light, full) -> None:
    assert type(light).__module__ == "types"  # read as JSON, not through transformers
    for read in (config_position_limit, encoder_position_limit, config_layers):
        assert read(light) == read(full), read.__name__


@pytest.mark.parametrize("config", [
    GPT2Config(n_layer=3, n_positions=96, n_embd=32, n_head=2),  # n_layer, n_positions: GPT-2's own names
    BertConfig(num_hidden_layers=2, max_position_embeddings=128, hidden_size=32, num_attention_heads=2),
    LlamaConfig(num_hidden_layers=5, max_position_embeddings=4096, hidden_size=32, num_attention_heads=2),
    RobertaConfig(num_hidden_layers=2, max_position_embeddings=130, hidden_size=32, num_attention_heads=2),
    XLMRobertaConfig(num_hidden_layers=2, max_position_embeddings=514, pad_token_id=1, hidden_size=32,
                     num_attention_heads=2),
    DebertaV2Config(num_hidden_layers=2, max_position_embeddings=512, position_biased_input=False, hidden_size=32,
                    num_attention_heads=2),  # relative positions: no limit
])
def test_a_saved_config_reads_as_autoconfig_does(tmp_path, config):
    config.save_pretrained(tmp_path)
    same_answers(model_config(tmp_path), AutoConfig.from_pretrained(str(tmp_path)))


@pytest.mark.parametrize("fields, limit, layers", [
    ({"model_type": "bert"}, 512, 12),  # BertConfig's defaults
    ({"model_type": "roberta", "max_position_embeddings": 514, "num_hidden_layers": 6}, 512, 6),  # pad_token_id 1
])
def test_a_file_without_the_fields_gets_the_model_class_defaults(tmp_path, fields, limit, layers):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    config = model_config(tmp_path)
    assert encoder_position_limit(config) == limit and config_layers(config) == layers


def test_an_unreadable_config_raises_as_autoconfig_does(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError):
        model_config(tmp_path)


def test_the_backbone_check_reads_gpt2_names(tmp_path):
    GPT2Config(n_layer=3, n_positions=96, n_embd=32, n_head=2).save_pretrained(tmp_path)
    settings = type("Settings", (), {"max_length": 64, "student": type("Student", (), {"layers": 3,
                                                                                       "max_length": None})()})()
    with pytest.raises(UserError, match="train_rm.student.layers=3 must be fewer than the reward-model backbone's 3"):
        check_backbone_fits(settings, tmp_path)
    settings.max_length = 97
    with pytest.raises(UserError, match="train_rm.max_length=97 is more than the reward-model backbone's 96"):
        check_backbone_fits(settings, tmp_path)
