"""Prompts as the policy reads them (its chat template or the prompt template, its BOS id) and the checks that
prompt plus response fit its positions. This module imports no torch (seconds) for the launcher, which checks prompt
lengths before any stage starts; loading the policy's tokenizer for that check still imports transformers."""
from __future__ import annotations

from rlaif.errors import UserError
from rlaif.models.loading import config_position_limit


def format_prompts(tokenizer, policy, prompts: list[str]) -> list[str]:
    """Prompts as the policy sees them: its tokenizer's chat template (one user turn) when it has one and the config
    allows it, else policy.prompt_template."""
    use_chat = (policy.chat_template if policy.chat_template is not None
                else bool(getattr(tokenizer, "chat_template", None)))
    if use_chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("policy.chat_template is true but the policy's tokenizer has no chat template: set "
                            "policy.chat_template=false to use policy.prompt_template")
        template = str(tokenizer.chat_template)
        if template not in _KEEPS_THE_PROMPT:  # a template may reshape a prompt, not drop it; checked once
            if PROBE not in _chat_turn(tokenizer, PROBE):
                raise UserError(f"the policy's chat template leaves the prompt out of its text: {TEMPLATE_FIX}")
            _KEEPS_THE_PROMPT.add(template)
        return [_chat_turn(tokenizer, p) for p in prompts]
    return [policy.prompt_template.format(prompt=p) for p in prompts]


PROBE = "Which prime follows seven?"
_KEEPS_THE_PROMPT: set[str] = set()  # chat templates whose probe showed the prompt
TEMPLATE_FIX = "fix the chat_template in its tokenizer_config.json, or set policy.chat_template=false"


def _chat_turn(tokenizer, prompt: str) -> str:
    """One user turn through the policy's chat template; a template that raises is one line."""
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # jinja's TemplateError, or whatever a template's own expressions raise (int + str)
        raise UserError(f"the policy's chat template fails ({type(exc).__name__}: {str(exc)[:160]}): "
                        f"{TEMPLATE_FIX}") from None


def leading_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer starts every encoding with (Llama, Mistral, Gemma), or None (GPT-2 and the demo policy
    start with none)."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer("a").input_ids[:1] == [bos] else None


def prompt_token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Formatted prompts as the policy's input ids: the text's own tokens (a chat template writes its special tokens
    as text), after the BOS id where the tokenizer starts sequences with one and the text does not already begin with
    it; a base model such as Llama reads a prompt without its BOS badly. Put as an id, not as text: BOS text would
    change how some tokenizers (Metaspace, prepend_scheme=first) split the first word. Every path that gives the policy
    a prompt (sampling in-process, served or on vLLM, PPO, evaluate, the length checks) encodes through this."""
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False).input_ids
    if (empty := next((text for text, row in zip(texts, ids) if text and not row), None)) is not None:
        raise UserError(f"the model's tokenizer encodes the prompt {empty[:60]!r} to no tokens (its vocabulary did "
                        "not load, or covers none of this text): save the model's tokenizer files with it")
    bos = leading_bos(tokenizer)
    return ids if bos is None else [row if row[:1] == [bos] else [bos, *row] for row in ids]


def position_limit(model) -> int | None:
    """The longest sequence a model's position embeddings cover (None where its config names no limit)."""
    from rlaif.models.adapters import unwrapped  # imports torch, which a loaded model has brought in already

    return config_position_limit(getattr(unwrapped(model), "config", None))


def check_fits(model, prompt_tokens: int, max_new_tokens: int, what: str = "a prompt",
               setting: str = "the stage's max_new_tokens", limit: int | None = None) -> None:
    """Prompt plus response within the model's positions (`limit`, else the model's; the last new token is never fed
    back): past them learned position embeddings index out of range (GPT-2) and rotary ones (Llama) give text the
    model was never trained on, silently."""
    limit = limit if limit is not None else position_limit(model)
    if limit is not None and prompt_tokens > limit:  # no max_new_tokens would fit it
        raise UserError(f"{what} of {prompt_tokens} tokens leaves none of the model's {limit} positions for a "
                        "response: shorten the prompts or their template (policy.prompt_template; "
                        "data.max_prompt_chars refuses long prompts when they are read)")
    if limit is not None and prompt_tokens + max_new_tokens - 1 > limit:
        raise UserError(f"{what} of {prompt_tokens} tokens plus {max_new_tokens} new tokens is longer than the "
                        f"model's {limit} positions: shorten the prompts or lower {setting}")


def check_prompts_fit(cfg, rows: list[dict]) -> None:
    """Before any stage runs: each sampling stage's longest formatted prompt plus its max_new_tokens within the
    policy's positions (a stage checks again as it samples, after the stages before it ran), where the policy's files
    are here without a build or a download; a tiny policy not built yet is held to its configured positions. PPO is
    held to every train prompt, any of which its rollouts may draw."""
    from rlaif.io.prompts import split_rows
    from rlaif.models.loading import TINY_LLAMA, load_tokenizer, local_policy_dir, model_config

    stages = [(name, getattr(cfg, name)) for name in ("generate", "ppo", "evaluate")
              if name != "generate" or cfg.generate.backend == "transformers"]  # vLLM and services check their own
    path = local_policy_dir(cfg.policy)
    if path is None and cfg.policy.model == TINY_LLAMA:
        limit = cfg.policy.tiny.max_positions
        for name, settings in stages:
            if settings.max_new_tokens > limit:
                raise UserError(f"{name}.max_new_tokens={settings.max_new_tokens} is more than the tiny policy's "
                                f"{limit} positions: lower it, or raise policy.tiny.max_positions")
    if path is None:
        return
    trust = cfg.policy.trust_remote_code
    try:
        limit = config_position_limit(model_config(path, trust))
        tokenizer = load_tokenizer(path, trust) if limit is not None else None
    except (OSError, ValueError):
        return  # what the stage's loader refuses with its own message
    if tokenizer is None:
        return
    first = {"generate": cfg.generate.max_prompts, "evaluate": cfg.evaluate.n_prompts}
    for name, settings in stages:
        held = split_rows(rows, cfg.data, "eval" if name == "evaluate" else "train")[: first.get(name)]
        texts = format_prompts(tokenizer, cfg.policy, [row["prompt"] for row in held])
        lengths = [len(ids) for ids in prompt_token_ids(tokenizer, texts)]
        longest = max(range(len(held)), key=lengths.__getitem__)
        check_fits(None, lengths[longest], settings.max_new_tokens, f"{name}: prompt {held[longest]['id']!r} "
                   "(formatted)", f"{name}.max_new_tokens", limit)
