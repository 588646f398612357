"""Users' own models, beyond the tiny Llama: checkpoints saved in half precision, ALiBi decoders, reward-model
backbones with another head, no pad token or a padded vocabulary, tokenizers that do not fit their model, chat
templates that raise, adapter directories. Each failed with a traceback before, most after stages had run."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from rlaif.config import load_config
from rlaif.errors import UserError
from rlaif.models.loading import check_tokenizer_files, load_causal_lm
from rlaif.models.policy import build_policy
from rlaif.models.reward import NormalisedScorer, load_reward_model


@pytest.fixture(scope="module")
def llama_dir():
    from rlaif.models.loading import resolve_policy

    return resolve_policy(load_config("configs/tiny.yaml").policy)


def save_model(model, out, tokenizer_from, tokenizer_edit=None):
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    if tokenizer_edit:
        config = json.loads((out / "tokenizer_config.json").read_text())
        tokenizer_edit(config)
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def llama_config(llama_dir, **fields):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(llama_dir))
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_checkpoint_is_trained_in_float32(llama_dir, tmp_path, dtype):
    """transformers 5 keeps a checkpoint's dtype: the fp32 value head then failed on bf16 hidden states in ppo."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    policy_dir = save_model(LlamaForCausalLM(llama_config(llama_dir)).to(dtype), tmp_path / "policy", llama_dir)
    assert load_causal_lm(policy_dir).dtype == torch.float32
    cfg = load_config("configs/tiny.yaml", [f"policy.model={policy_dir}", "ppo.lora_rank=0"])
    _, policy, _ = build_policy(cfg, torch.device("cpu"))
    prompts, responses = torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]])
    hidden = policy.lm.model(torch.cat([prompts, responses], 1)).last_hidden_state[:, 2:4]
    logprobs, values = policy.from_hidden(hidden, responses)  # the sampler's path, where the dtypes met
    assert logprobs.dtype == values.dtype == torch.float32
    classifier = LlamaForSequenceClassification(llama_config(llama_dir, num_labels=1)).to(dtype)
    rm_dir = save_model(classifier, tmp_path / "rm", llama_dir)
    assert load_reward_model(rm_dir)[1].dtype == torch.float32


def test_an_alibi_decoder_samples_through_generate(llama_dir, tmp_path):
    """The static decoder passes a prepared 4D mask, from which ALiBi models cannot build their biases."""
    from transformers import FalconConfig, FalconForCausalLM

    from rlaif.models.decode import supports_static_decode
    from rlaif.models.generation import encode_prompts, sample
    from rlaif.models.loading import load_tokenizer

    tokenizer = load_tokenizer(llama_dir)
    config = FalconConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          alibi=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = FalconForCausalLM(config).eval()
    assert not supports_static_decode(model)
    assert supports_static_decode(FalconForCausalLM(FalconConfig(**{**config.to_dict(), "alibi": False})))
    enc = encode_prompts(tokenizer, ["Question: hi\nAnswer:", "Question: a longer one\nAnswer:"], "cpu")
    out = sample(model, tokenizer, enc, max_new_tokens=4, temperature=1.0, seed=0, min_new_tokens=4)
    assert out.shape == (2, 4)


def test_reward_backbones_with_another_head_or_no_pad_token_load(llama_dir, tmp_path):
    from transformers import LlamaForSequenceClassification

    two_labels = save_model(LlamaForSequenceClassification(llama_config(llama_dir, num_labels=2)),
                            tmp_path / "two", llama_dir)
    tokenizer, model = load_reward_model(two_labels)
    assert model.score.out_features == 1  # a fresh one-score head, as an encoder gets
    config = json.loads((two_labels / "config.json").read_text())
    wider = {**config, "intermediate_size": 2 * config["intermediate_size"]}
    (two_labels / "config.json").write_text(json.dumps(wider))
    with pytest.raises(UserError, match="do not fit its config.json .*mlp"):  # not silently re-initialised
        load_reward_model(two_labels)
    no_pad = save_model(LlamaForSequenceClassification(llama_config(llama_dir, num_labels=1, pad_token_id=None)),
                        tmp_path / "no-pad", llama_dir, lambda config: config.pop("pad_token", None))
    tokenizer, model = load_reward_model(no_pad)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    enc = tokenizer(["a", "a longer prompt"], ["x", "y"], padding=True, return_tensors="pt")
    assert model(**enc).logits.shape == (2, 1)


def test_tokenizers_that_do_not_fit_their_model_are_refused_before_any_work(llama_dir, tmp_path):
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from rlaif.models.loading import load_tokenizer

    tokens = len(load_tokenizer(llama_dir))
    small = save_model(LlamaForSequenceClassification(llama_config(llama_dir, vocab_size=tokens - 12, num_labels=1)),
                       tmp_path / "small", llama_dir)
    with pytest.raises(UserError, match=f"has {tokens} tokens but the model has {tokens - 12} embeddings"):
        check_tokenizer_files(small, "reward-model backbone", False)
    with pytest.raises(UserError, match=f"has {tokens} tokens but the model has {tokens - 12} embeddings"):
        load_reward_model(small)
    no_eos = save_model(LlamaForCausalLM(llama_config(llama_dir)), tmp_path / "no-eos", llama_dir,
                        lambda config: config.update(eos_token=None))
    with pytest.raises(UserError, match="no EOS token"):
        check_tokenizer_files(no_eos, "policy model", False)
    check_tokenizer_files(llama_dir, "policy model", False)


def test_token_ids_past_the_reward_tokenizer_score_as_their_text_does(llama_dir, tmp_path):
    """A policy whose embedding table is padded past its tokenizer can sample ids no token has; decoded to text they
    are nothing, and the token-id path indexed the reward model's smaller table with them."""
    from transformers import LlamaForSequenceClassification

    from rlaif.models.generation import decode
    from rlaif.models.loading import load_tokenizer

    tokenizer = load_tokenizer(llama_dir)
    torch.manual_seed(0)
    rm_dir = save_model(LlamaForSequenceClassification(llama_config(llama_dir, num_labels=1)), tmp_path / "rm",
                        llama_dir)
    (rm_dir / "reward_stats.json").write_text(json.dumps({"mean": 0.0, "std": 1.0, "max_length": 64}))
    scorer = NormalisedScorer(rm_dir, torch.device("cpu"))
    past = len(tokenizer) + 5
    responses = torch.tensor([[40, past, 41, 42], [past, 43, 44, past]])
    mask = torch.ones_like(responses)
    texts = decode(tokenizer, responses, mask)
    prompts = ["Question: one\nAnswer:", "Question: two\nAnswer:"]
    assert torch.allclose(scorer.score_tokens(prompts, responses, mask), scorer(prompts, texts), atol=1e-5)


def test_a_chat_template_that_raises_any_error_is_one_line(llama_dir, tmp_path):
    from rlaif.models.loading import load_tokenizer
    from rlaif.models.prompt_text import format_prompts

    tokenizer = load_tokenizer(llama_dir)
    tokenizer.chat_template = "{{ messages[0]['content'] | int + 'x' }}"  # a TypeError inside the template
    with pytest.raises(UserError, match="chat template fails .*TypeError"):
        format_prompts(tokenizer, load_config("configs/tiny.yaml").policy, ["hi"])


def test_an_adapter_directory_given_as_a_model_says_to_merge_it(tmp_path):
    from rlaif.models.files import check_model_dir

    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="holds a PEFT adapter.*merge_and_unload"):
        check_model_dir(tmp_path, "policy model")


def test_a_model_is_saved_without_importing_deepspeed(llama_dir, tmp_path):
    """save_pretrained imports DeepSpeed (seconds) wherever it is installed, only to ask whether the model is a
    DeepSpeed engine; save_model answers no without the import where DeepSpeed is not loaded, asks as before where it
    is, writes the same files, and leaves accelerate's probe as it found it, after a failed save too. A fresh
    process: this one may have loaded DeepSpeed in another test."""
    pytest.importorskip("deepspeed")
    code = f"""
import sys, filecmp
from accelerate.utils import other
from transformers import AutoModelForCausalLM
from rlaif.models.files import save_model
probe, answers = other.is_deepspeed_available, []

class Asks:
    def save_pretrained(self, out, **options):
        answers.append(other.is_deepspeed_available())
        if out == "fail":
            raise OSError("disk full")

model = AutoModelForCausalLM.from_pretrained({str(llama_dir)!r})
save_model(model, {str(tmp_path / "ours")!r})
save_model(Asks(), "asks")
try:
    save_model(Asks(), "fail")
except OSError:
    pass
assert "deepspeed" not in sys.modules and other.is_deepspeed_available is probe
model.save_pretrained({str(tmp_path / "plain")!r}, safe_serialization=True)
assert "deepspeed" in sys.modules  # the probe this skips is real
save_model(Asks(), "asks")
assert answers == [False, False, True] and other.is_deepspeed_available is probe, answers
names = ["config.json", "generation_config.json", "model.safetensors"]
assert filecmp.cmpfiles({str(tmp_path / "ours")!r}, {str(tmp_path / "plain")!r}, names, shallow=False)[0] == names
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def gpt2_with_unit_positions(tokenizer, head: str = "lm"):
    """A GPT-2 whose learned position embeddings are of a trained model's scale: at the default 0.02 initialisation
    a shift of positions moves the outputs by ~1e-3, and the tests below would pass on the bug."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128, num_labels=1,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = (GPT2LMHeadModel if head == "lm" else GPT2ForSequenceClassification)(config).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_()
    return model


def test_a_judge_with_learned_positions_answers_each_row_as_alone(llama_dir):
    # The hf judge left-pads its prompts: GPT-2 counted the padding as positions, and a row's P(answer) depended on
    # the longest row of its batch (0.11 alone, 0.0002 beside a longer prompt).
    from rlaif.models.generation import next_token_logprobs
    from rlaif.models.loading import load_tokenizer

    tokenizer = load_tokenizer(llama_dir)  # pads on the left
    model = gpt2_with_unit_positions(tokenizer)
    texts = ["Which is better? Preferred response:", "A much longer comparison of two answers, with the principle "
             "written out in full before it. Preferred response:"]
    alone = next_token_logprobs(model, dict(tokenizer(texts[:1], return_tensors="pt")))
    batched = next_token_logprobs(model, dict(tokenizer(texts, return_tensors="pt", padding=True)))
    assert torch.allclose(batched[0], alone[0], atol=1e-5)


@pytest.mark.parametrize("case", ["left-padding tokenizer", "config pad id not the tokenizer's"])
def test_a_reward_model_scores_each_pair_as_alone(llama_dir, tmp_path, case):
    # A GPT-2 backbone whose tokenizer pads on the left scored by batch (learned positions); a config.json naming
    # another pad id than the tokenizer pads with pooled a padding token. Both ran to the end of the pipeline.
    from rlaif.models.loading import load_tokenizer
    from rlaif.models.reward import batched_rewards

    tokenizer = load_tokenizer(llama_dir)
    if case == "left-padding tokenizer":
        model = gpt2_with_unit_positions(tokenizer, head="classifier")
        edit = lambda config: config.update(padding_side="left")  # noqa: E731
    else:
        from transformers import LlamaForSequenceClassification

        torch.manual_seed(0)
        model = LlamaForSequenceClassification(llama_config(llama_dir, num_labels=1, pad_token_id=5))
        edit = None
    loaded_tokenizer, loaded = load_reward_model(save_model(model, tmp_path / "rm", llama_dir, edit))
    prompts, responses = ["Hi", "A much longer prompt than the first one, by far"], ["Hello there.", "Sure."]
    alone = batched_rewards(loaded, loaded_tokenizer, prompts[:1], responses[:1], 128, "cpu")
    batched = batched_rewards(loaded, loaded_tokenizer, prompts, responses, 128, "cpu")
    assert torch.allclose(batched[:1], alone, atol=1e-5), (batched, alone)


def test_sampling_through_generate_ignores_the_models_generation_config(llama_dir, tmp_path):
    # generate() fills what its call leaves unset from generation_config.json: suppress_tokens and a repetition
    # penalty sampled from another distribution than the one PPO's log-probs and KL are computed for (a negative KL
    # in a probe), and only on the generate() path (a stop string, sliding-window and ALiBi models).
    from rlaif.models.generation import encode_prompts, sample_seeded
    from rlaif.models.loading import load_tokenizer

    tokenizer = load_tokenizer(llama_dir)
    plain = load_causal_lm(llama_dir).eval()
    odd_dir = tmp_path / "odd"
    shutil.copytree(llama_dir, odd_dir)
    settings = json.loads((odd_dir / "generation_config.json").read_text())
    keep = {tokenizer.eos_token_id, *tokenizer("the a and", add_special_tokens=False).input_ids}
    (odd_dir / "generation_config.json").write_text(json.dumps({
        **settings, "repetition_penalty": 5.0, "no_repeat_ngram_size": 2,
        "suppress_tokens": [i for i in range(len(tokenizer)) if i not in keep]}))
    odd = load_causal_lm(odd_dir).eval()
    enc = encode_prompts(tokenizer, ["Question: How do I boil an egg?\nAnswer:"], "cpu")
    runs = [sample_seeded(model, tokenizer, enc, [7], max_new_tokens=10, temperature=1.0, stop=["zzzz"])
            for model in (plain, odd)]
    assert runs[0].tolist() == runs[1].tolist()
    assert odd.generation_config.repetition_penalty == 5.0  # the model's own settings are back after the call
    # PPO's rollouts: sample() through generate() on a LoRA-wrapped policy (its adapter starts as a no-op)
    from peft import LoraConfig, get_peft_model

    from rlaif.models.generation import sample

    wrapped = get_peft_model(odd, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    runs = [sample(model, tokenizer, enc, max_new_tokens=10, temperature=1.0, seed=3, decoder="generate")
            for model in (plain, wrapped)]
    assert runs[0].tolist() == runs[1].tolist()


def test_a_half_precision_or_fp8_config_passes_the_launch_build(llama_dir, tmp_path):
    # The launch check builds the class as the loaders load it, in float32: a config saved in fp8 was refused there.
    from rlaif.models.loading import check_buildable

    for dtype in ("bfloat16", "float8_e4m3fn"):
        model = tmp_path / dtype
        shutil.copytree(llama_dir, model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
        check_buildable(model, "policy model", trust_remote_code=False)
        check_buildable(model, "reward-model backbone", trust_remote_code=False)


def test_decoders_that_place_their_own_positions_are_given_none(llama_dir):
    # RoBERTa's family offsets positions past its padding index from the input ids: 0-based ids would shift them.
    from transformers import RobertaConfig, RobertaForCausalLM

    from rlaif.models.generation import row_positions

    mask = torch.tensor([[0, 1, 1]])
    roberta = RobertaForCausalLM(RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32, is_decoder=True))
    assert row_positions(roberta, mask) == {}
    assert row_positions(load_causal_lm(llama_dir), mask)["position_ids"].tolist() == [[0, 0, 1]]
