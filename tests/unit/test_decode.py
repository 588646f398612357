"""The static decoder (rlaif.models.decode) on the CPU, without the CUDA graph: greedy decoding equals transformers'
generate on left-padded batches, a row's sample depends only on its seed, the inverse-CDF sampler draws from the
filtered softmax, fixed-length rollouts never end early, and the counter hash is the same everywhere (golden values).
On a GPU, bench/bench_generation.py checks the captured graph against these eager steps token for token."""
import pytest
import torch

from rlaif.errors import UserError
from rlaif.models.decode import choose_tokens, decode_static, mix32, row_uniforms, seed_keys

EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=EOS, pad_token_id=PAD)
    return LlamaForCausalLM(config).eval()


def left_padded(rows: list[list[int]]) -> dict:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


PROMPTS = [[5, 9, 13, 2, 40], [7, 3], [11, 12, 13], [60, 61, 62, 63, 8, 8, 30]]


def test_greedy_equals_transformers_generate(model):
    enc = left_padded(PROMPTS)
    ours = decode_static(model, enc, [0] * 4, max_new_tokens=12, temperature=0, eos_ids=[EOS], pad_id=PAD)
    theirs = model.generate(**enc, do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, theirs[:, enc["input_ids"].shape[1]:])


def test_cpu_steps_read_only_the_key_slots_written_so_far(model, monkeypatch):
    """Off CUDA, attention reads the prompt and the tokens fed so far, not the whole preallocated cache, and samples
    what reading every slot (as a captured graph does) samples."""
    import torch.nn.functional as F

    from rlaif.models.decode import StaticDecode, key_slots

    sdpa, read = F.scaled_dot_product_attention, []

    def spy(query, key, *args, **kwargs):
        read.append(key.shape[2])
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    enc, steps, layers = left_padded(PROMPTS), 9, model.config.num_hidden_layers
    run = dict(max_new_tokens=steps, min_new_tokens=steps, temperature=1.0, eos_ids=[EOS], pad_id=PAD)
    trimmed = decode_static(model, enc, [1, 2, 3, 4], **run)
    width = enc["input_ids"].shape[1]
    assert read == [width + fed for fed in range(steps) for _ in range(layers)]
    read.clear()
    monkeypatch.setattr(StaticDecode, "_read_slots", lambda self, written: None)
    every_slot = decode_static(model, enc, [1, 2, 3, 4], **run)
    assert set(read) == {key_slots(width, steps)} and torch.equal(trimmed, every_slot)


def test_sliding_window_models_sample_through_generate():
    """A sliding-window layer's cache keeps the window's keys only: the static decoder's mask over every slot would
    not fit them once a row outgrows the window, so such models sample through generate()."""
    from types import SimpleNamespace

    from transformers import MistralConfig, MistralForCausalLM

    from rlaif.models import generation

    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=4, eos_token_id=EOS, pad_token_id=PAD)).eval()
    enc = left_padded(PROMPTS)
    assert not generation.static_decoder_applies(windowed, enc, "auto")
    tokens = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    out = generation.sample(windowed, tokens, enc, max_new_tokens=8, min_new_tokens=8, temperature=1.0, seed=0)
    assert out.shape == (4, 8)
    with pytest.raises(UserError, match="static decoder cannot run this model"):  # forced: one clear line
        generation.sample(windowed, tokens, enc, max_new_tokens=8, temperature=1.0, decoder="static")


def test_a_rows_sample_depends_only_on_its_seed(model):
    together = decode_static(model, left_padded(PROMPTS), [11, 22, 33, 44], max_new_tokens=10, temperature=1.0,
                             eos_ids=[EOS], pad_id=PAD)
    alone = decode_static(model, left_padded([PROMPTS[1]]), [22], max_new_tokens=10, temperature=1.0, eos_ids=[EOS],
                          pad_id=PAD)
    other_partners = decode_static(model, left_padded([PROMPTS[2], PROMPTS[1]]), [5, 22], max_new_tokens=10,
                                   temperature=1.0, eos_ids=[EOS], pad_id=PAD)
    width = alone.shape[1]
    assert torch.equal(together[1, :width], alone[0]) and torch.equal(other_partners[1, :width], alone[0])
    reseeded = decode_static(model, left_padded([PROMPTS[1]]), [23], max_new_tokens=10, temperature=1.0, eos_ids=[EOS],
                             pad_id=PAD)
    assert not torch.equal(reseeded, alone)


def test_rows_end_at_eos_and_fixed_length_runs_to_the_end(model):
    # A bias towards EOS makes most rows end early; barring it until max_new_tokens makes none do.
    model.lm_head.weight.data[EOS] += 0.5 * model.model.embed_tokens.weight.data.mean(0).sign()
    try:
        enc = left_padded(PROMPTS)
        free = decode_static(model, enc, [1, 2, 3, 4], max_new_tokens=16, temperature=1.0, eos_ids=[EOS], pad_id=PAD)
        fixed = decode_static(model, enc, [1, 2, 3, 4], max_new_tokens=16, temperature=1.0, eos_ids=[EOS], pad_id=PAD,
                              min_new_tokens=16)
    finally:
        model.lm_head.weight.data[EOS] -= 0.5 * model.model.embed_tokens.weight.data.mean(0).sign()
    assert fixed.shape == (4, 16) and not (fixed == EOS).any()
    for row in free:
        ends = (row == EOS).nonzero()
        if len(ends):
            assert (row[int(ends[0]) + 1:] == PAD).all()


def test_inverse_cdf_sampling_matches_the_filtered_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    rows = 40_000
    keys = seed_keys(list(range(rows)), "cpu")
    draws = choose_tokens(logits.expand(rows, -1), row_uniforms(keys, torch.tensor(3)), temperature=0.8)
    frequency = torch.bincount(draws, minlength=12).float() / rows
    expected = torch.softmax(logits[0] / 0.8, -1)
    assert (frequency - expected).abs().max() < 0.01

    top_k = choose_tokens(logits.expand(rows, -1), row_uniforms(keys, torch.tensor(4)), temperature=1.0, top_k=3)
    assert set(top_k.unique().tolist()) == set(logits[0].topk(3).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    ordered = probs.sort(descending=True)
    kept = int((ordered.values.cumsum(0) - ordered.values < 0.7).sum())
    top_p = choose_tokens(logits.expand(rows, -1), row_uniforms(keys, torch.tensor(5)), temperature=1.0, top_p=0.7)
    assert set(top_p.unique().tolist()) == set(ordered.indices[:kept].tolist())


def test_the_counter_hash_is_fixed_and_uniform():
    # The tensor hash equals plain Python integers (int64 arithmetic without overflow), on any device: a seed means
    # the same draws on a CPU and a GPU.
    def reference(x: int) -> int:
        for multiplier in (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39):
            x = ((x ^ (x >> 16)) * multiplier) % 2**32
        return x ^ (x >> 16)

    values = [0, 1, 2, 12345, 2**31, 2**32 - 1]
    assert mix32(torch.tensor(values)).tolist() == [reference(v) for v in values]
    assert len(set(mix32(torch.arange(100_000)).tolist())) == 100_000  # a bijection: no two counters collide
    assert seed_keys([7, 7 + 2**64], "cpu").tolist()[0] != seed_keys([8], "cpu").tolist()[0]
    uniforms = row_uniforms(seed_keys(list(range(100_000)), "cpu"), torch.tensor(0))
    assert 0 < float(uniforms.min()) and float(uniforms.max()) < 1
    assert abs(float(uniforms.mean()) - 0.5) < 0.005 and abs(float(uniforms.var()) - 1 / 12) < 0.002


def test_fixed_length_through_transformers_generate_too(model):
    from types import SimpleNamespace

    from rlaif.models.generation import sample_seeded

    tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    model.lm_head.weight.data[EOS] += 5.0  # EOS is the likeliest token everywhere
    try:
        out = sample_seeded(model, tokenizer, left_padded(PROMPTS), [1, 2, 3, 4], max_new_tokens=9, temperature=1.0,
                            min_new_tokens=9, decoder="generate")
        free = sample_seeded(model, tokenizer, left_padded(PROMPTS), [1, 2, 3, 4], max_new_tokens=9, temperature=1.0,
                             decoder="generate")
    finally:
        model.lm_head.weight.data[EOS] -= 5.0
    assert out.shape == (4, 9) and not (out == EOS).any()
    assert free.shape[1] < 9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_captured_graph_replays_the_eager_steps(model):
    from types import SimpleNamespace

    from rlaif.models.generation import sample

    gpu = model.cuda()
    try:
        enc = {k: v.cuda() for k, v in left_padded(PROMPTS * 8).items()}
        seeds = list(range(32))
        kwargs = dict(max_new_tokens=24, temperature=1.0, top_k=20, eos_ids=[EOS], pad_id=PAD)
        graph = decode_static(gpu, enc, seeds, cuda_graph=True, **kwargs)
        eager = decode_static(gpu, enc, seeds, cuda_graph=False, **kwargs)
        assert torch.equal(graph, eager)
        # The next batch of that shape (other prompts, one token shorter, each 8 times in adjacent rows, so the
        # prefill spreads each prompt's keys and values over its rows; other seeds) replays the kept graph.
        other = {k: v.cuda() for k, v in left_padded([p[1:] or p for p in reversed(PROMPTS) for _ in range(8)]).items()}
        replayed = decode_static(gpu, other, seeds[::-1], cuda_graph=True, **kwargs)
        assert torch.equal(replayed, decode_static(gpu, other, seeds[::-1], cuda_graph=False, **kwargs))
        tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
        two = sample(gpu, tokenizer, enc, max_new_tokens=24, temperature=1.0, num_return_sequences=2, seed=3)
        assert two.shape[0] == 64 and torch.equal(two, sample(gpu, tokenizer, enc, max_new_tokens=24,
                                                              temperature=1.0, num_return_sequences=2, seed=3))
    finally:
        model.cpu()


def test_a_finished_decode_frees_its_cache_without_the_garbage_collector(model, monkeypatch):
    # The dtype wrapper on each cache layer once formed a reference cycle: every rollout's KV cache then waited for
    # a full GC pass, and a PPO run's RSS crept up by tens of MiB per iteration on the CPU.
    import gc
    import weakref

    from rlaif.models import decode

    caches = []
    init = decode.StaticDecode.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(weakref.ref(self.cache.layers[0]))

    monkeypatch.setattr(decode.StaticDecode, "__init__", recording_init)
    gc.disable()
    try:
        decode_static(model, left_padded(PROMPTS), [1, 2, 3, 4], max_new_tokens=6, temperature=1.0, eos_ids=[EOS],
                      pad_id=PAD)
        # a batch whose prefill spreads each prompt's keys and values over its rows
        decode_static(model, left_padded([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2), [1, 2, 3, 4], max_new_tokens=6,
                      temperature=1.0, eos_ids=[EOS], pad_id=PAD)
        assert len(caches) == 2 and caches[0]() is None and caches[1]() is None
    finally:
        gc.enable()


def test_auto_takes_the_static_decoder_on_cpus_too(model, monkeypatch):
    from types import SimpleNamespace

    from rlaif.models import generation

    monkeypatch.delenv("RLAIF_DECODER", raising=False)
    enc = left_padded(PROMPTS)
    assert generation.static_decoder_applies(model, enc, "auto")
    assert not generation.static_decoder_applies(model, enc, "auto", stop=("\n",))  # stop strings: generate()
    tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    seeds = [3, 4, 5, 6]
    through_sample = generation.sample_seeded(model, tokenizer, enc, seeds, max_new_tokens=8, temperature=1.0)
    assert torch.equal(through_sample, decode_static(model, enc, seeds, max_new_tokens=8, temperature=1.0,
                                                     eos_ids=[EOS], pad_id=PAD))


def test_adjacent_rows_with_one_prompt_prefill_it_once(model, monkeypatch):
    # A GRPO group's samples (and a pair's two) are adjacent rows with one prompt: the prefill runs it once and
    # writes its keys and values into each row. Same tokens and sampled-from hidden states as a prefill of every row;
    # a repeat that is not adjacent runs again.
    from types import SimpleNamespace

    from rlaif.models import decode, generation

    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] + [PROMPTS[2]] * 2 + [PROMPTS[0]]
    seeds = [5, 6, 7, 8, 9, 10, 11]
    tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    kwargs = dict(temperature=1.0, seed=1, want_hidden=True, decoder="static")
    prefill_batch_sizes = []
    handle = model.register_forward_pre_hook(  # decode steps feed one column
        lambda _m, _a, kw: prefill_batch_sizes.append(len(kw["input_ids"])) if kw["input_ids"].shape[1] > 1 else None,
        with_kwargs=True)

    def run_all():
        return (decode_static(model, left_padded(prompts), seeds, max_new_tokens=10, temperature=1.0, eos_ids=[EOS],
                              pad_id=PAD),
                generation.sample(model, tokenizer, left_padded(PROMPTS), max_new_tokens=8, num_return_sequences=3,
                                  **kwargs),
                generation.sample(model, tokenizer, left_padded(PROMPTS[1:2]), max_new_tokens=1,
                                  num_return_sequences=4, **kwargs))

    try:
        shared = run_all()
        monkeypatch.setattr(decode, "prompt_runs", lambda *_: None)
        every_row = run_all()
    finally:
        handle.remove()
    # P0 P1 P2 P0; four prompts of three samples; one prompt of four; then every row
    assert prefill_batch_sizes == [4, 4, 1, 7, 12, 4]
    assert torch.equal(shared[0], every_row[0])
    for ours, theirs in zip(shared[1:], every_row[1:]):
        assert torch.equal(ours[0], theirs[0]) and ours[1].shape == theirs[1].shape
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)


def test_a_step_draws_the_uniform_of_its_row_and_index(model):
    from rlaif.models.decode import StaticDecode

    state = StaticDecode(model, 4, 32, "cpu", max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, eos_ids=[EOS],
                         pad_id=PAD, min_new_tokens=0)
    seeds = [3, 2**40 + 7, 11, 3]
    state.load(left_padded(PROMPTS), seeds)
    for index in range(6):
        assert torch.equal(state.uniforms[:, index], row_uniforms(seed_keys(seeds, "cpu"), torch.tensor(index)))
