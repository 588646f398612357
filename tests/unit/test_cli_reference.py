"""The CLI documents itself from the config models, so it cannot drift: `rlaif config` lists every setting with its
type, default and doc; an unknown key suggests the nearest real one; `rlaif --version`."""
import pytest

from rlaif import __version__
from rlaif.cli import main
from rlaif.config import PipelineConfig, config_fields


def test_config_lists_every_setting_with_its_doc(capsys):
    assert main(["config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [k for k, *_ in config_fields()]
    assert len(lines) == len(keys) > 100 and len(set(keys)) == len(keys)
    assert "ppo.kl_coef (float, default 0.05): " in "\n".join(lines)
    assert all(doc for *_, doc in config_fields())  # every field has a docstring
    for key in keys:  # every listed key is a real setting: setting it to its own default validates
        section = PipelineConfig()
        for part in key.split(".")[:-1]:
            section = getattr(section, part)
        assert hasattr(section, key.rsplit(".", 1)[-1])


def test_unknown_keys_suggest_the_nearest(capsys):
    assert main(["run", "--set", "ppo.iteration=3"]) == 2
    assert "unknown config key 'ppo.iteration' (did you mean 'ppo.iterations'?)" in capsys.readouterr().err
    assert main(["run", "--set", "evalute.n_prompts=3"]) == 2
    assert "(did you mean 'evaluate'?)" in capsys.readouterr().err
    assert main(["run", "--set", "ppo.learning_rate=1"]) == 2
    assert "did you mean" not in capsys.readouterr().err  # nothing close enough: no guess


def test_a_dotted_key_written_in_yaml_is_told_to_nest(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("ppo.iterations: 3\n")  # one YAML key named 'ppo.iterations', not ppo's iterations
    assert main(["run", "--config", str(config)]) == 2
    assert "unknown config key 'ppo.iterations' (a dotted name is one key in YAML: nest it, 'ppo:' then" \
        in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"rlaif {__version__}"
