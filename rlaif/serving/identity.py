"""Which model a service serves, as a digest both ends compute from their config: a stage refuses a service that
serves another model (or runs another engine), so an endpoint run computes what an in-process run computes and may
share its cache key."""
from __future__ import annotations

from rlaif.config import PipelineConfig, cache_key_dump, sha256_json
from rlaif.errors import UserError
from rlaif.io.digest import spec_digest

BUILTIN_POLICY = "builtin:tiny-llama"


def policy_digest(policy) -> str:
    """The policy section and the content of the model (or of the built-in policy's demonstrations)."""
    spec = policy.tiny.demonstrations if policy.model == BUILTIN_POLICY else policy.model
    return sha256_json(["policy", cache_key_dump(policy), spec_digest(spec, model=True)])


def judge_digest(hf) -> str:
    """An hf judge's model spec, its remote-code switch and the model's content."""
    return sha256_json(["judge", hf.model, hf.trust_remote_code, spec_digest(hf.model, model=True)])


def model_digest(cfg: PipelineConfig, model: str) -> str:
    return policy_digest(cfg.policy) if model == "policy" else judge_digest(cfg.label.hf)


def check_service(client, role: str, digest: str, engine: str | None) -> dict:
    """The service's own description, once it is known to serve this model (and engine); else a one-line error."""
    data = client.get("/models")
    try:
        info = data["data"][0]["rlaif"]
        served, served_engine = info["model_digest"], info["engine"]
    except (KeyError, IndexError, TypeError):
        raise UserError(f"{client.base_url} is not an `rlaif serve` service (its /models does not say which model it "
                        f"serves): serve this config's {role} with `rlaif serve --config <this config> "
                        f"--set serve.model={role}`") from None
    if served != digest:
        raise UserError(f"{client.base_url} serves another {role} than this config names (model digest "
                        f"{served[:12]}, expected {digest[:12]}): serve this config's {role} with `rlaif serve "
                        f"--config <this config> --set serve.model={role}`, or fix {client.section}.base_url")
    if engine and served_engine != engine:
        raise UserError(f"{client.base_url} runs the {served_engine} engine, this config expects {engine}: set "
                        f"generate.endpoint_engine={served_engine} or serve with serve.engine={engine}")
    return info
