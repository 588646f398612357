"""A policy whose tokenizer starts every sequence with BOS (Llama, Mistral, Gemma) reads its prompts with BOS on every
path: in-process sampling, PPO and evaluate (encode_prompts), the length checks, the model service and vLLM
(serving.engine.token_ids, prompt_token_ids). Before, prompts were encoded without special tokens, so a base model
sampled from prompts it had never seen without their BOS; a tokenizer that adds none (the demo's) is unchanged."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from rlaif.models.generation import encode_prompts
from rlaif.models.loading import load_tokenizer
from rlaif.models.prompt_text import leading_bos, prompt_token_ids
from rlaif.serving.engine import token_ids

CORPUS = ["Explain how to water a plant.", "Hello world, how are you today?", "List three steps to bake bread.",
          "Why is the sky blue?"] * 20
TEXTS = ["Hello world", "Explain how to bake bread.", "Why?"]


def bos_tokenizer(out, pre_tokenizer, decoder):
    """A BPE tokenizer saved as a model's would be, whose post-processor puts <s> first, as Llama's does."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120,
                                                        special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(out)
    return load_tokenizer(out)


@pytest.fixture(params=["metaspace-first", "byte-level"])
def tokenizer(request, tmp_path):
    if request.param == "metaspace-first":  # BOS as text would change how this one splits the first word
        return bos_tokenizer(tmp_path, pre_tokenizers.Metaspace(prepend_scheme="first"),
                             decoders.Metaspace(prepend_scheme="first"))
    return bos_tokenizer(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())


def test_prompts_are_encoded_as_the_tokenizer_encodes_a_sequence(tokenizer):
    assert leading_bos(tokenizer) == tokenizer.bos_token_id == 1
    assert prompt_token_ids(tokenizer, TEXTS) == [tokenizer(text).input_ids for text in TEXTS]
    assert prompt_token_ids(tokenizer, []) == []


def test_a_chat_template_that_writes_bos_gets_one_bos(tokenizer):
    templated = "<s>[INST] Hello world [/INST]"
    (ids,) = prompt_token_ids(tokenizer, [templated])
    assert ids[0] == 1 and ids[1] != 1
    assert ids == tokenizer(templated, add_special_tokens=False).input_ids


def test_batches_are_left_padded_after_bos(tokenizer):
    enc = encode_prompts(tokenizer, TEXTS, "cpu")
    for ids, mask, text in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist(), TEXTS):
        real = [token for token, keep in zip(ids, mask) if keep]
        assert real == tokenizer(text).input_ids and mask == sorted(mask)  # padding on the left only


def test_served_text_prompts_are_encoded_as_in_process_and_ids_pass_as_sent(tokenizer):
    sent = ["Why?", [7, 8, 9], "Hello world"]
    assert token_ids(tokenizer, sent) == [tokenizer("Why?").input_ids, [7, 8, 9], tokenizer("Hello world").input_ids]


def test_a_tokenizer_without_bos_is_unchanged():
    from rlaif.config import load_config
    from rlaif.models.loading import resolve_policy

    demo = load_tokenizer(resolve_policy(load_config("configs/tiny.yaml").policy))
    assert leading_bos(demo) is None
    assert prompt_token_ids(demo, TEXTS) == demo(TEXTS, add_special_tokens=False).input_ids
