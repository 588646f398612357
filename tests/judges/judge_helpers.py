"""The tiny causal-LM judge, an OpenAI-compatible server of it on loopback, and a committed generate output:
shared by the judge tests (a module of its own: a test importing `conftest` may get another folder's)."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from rlaif.config import LabelConfig

CORPUS = [f"Request: question {i}\nResponse 1: answer {i}\nResponse 2: other {i}\nPreferred response: {1 + i % 2}\n"
          f"Rationale: because {i}. Score (1 to 10): {1 + i % 10}/10" for i in range(200)]


def build_judge_model(out, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlaif.models.tiny import _train_tokenizer

    tokenizer = _train_tokenizer(CORPUS, 300)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=1024,
                                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    # A few steps on the judge format, so the answer tokens " 1"/" 2" follow the cue (and show up in top log-probs).
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in CORPUS]
    width = max(map(len, ids))
    batch = torch.full((len(ids), width), tokenizer.pad_token_id)
    for row, seq in enumerate(ids):
        batch[row, : len(seq)] = torch.tensor(seq)
    labels = batch.masked_fill(batch == tokenizer.pad_token_id, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(60):
        pick = torch.randint(len(ids), (32,), generator=gen)
        model(input_ids=batch[pick], labels=labels[pick]).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def settings(**fields) -> LabelConfig:
    return LabelConfig.model_validate(fields)


class JudgeServer:
    """/v1/completions and /v1/chat/completions answering one token with its top log-probs from the tiny judge.
    `faults` maps a request number (1-based) to '429', '500', 'timeout' (sleeps past the client's timeout) or
    '401'. Every request is recorded. `answer`: a fixed answer text in place of the model's top token."""

    def __init__(self, model_dir, faults=None, sleep_s=2.0, logprobs=True, answer=None):
        from rlaif.models.loading import load_causal_lm, load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_causal_lm(model_dir).eval()
        self.faults, self.sleep_s, self.logprobs, self.answer = faults or {}, sleep_s, logprobs, answer
        self.requests, self.lock = [], threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                    fault = server.faults.get(len(server.requests))
                if fault == "timeout":
                    time.sleep(server.sleep_s)
                elif fault in ("429", "500", "401"):
                    self.send_response(int(fault))
                    self.send_header("Retry-After", "0") if fault == "429" else None
                    self.end_headers()
                    self.wfile.write(b'{"error": "injected"}')
                    return
                payload = json.dumps(server.complete(self.path, body)).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a slow answer: it retries
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @torch.no_grad()
    def complete(self, path, body):
        text = body["prompt"] if path.endswith("/completions") and "prompt" in body else body["messages"][-1]["content"]
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with self.lock:
            logp = torch.log_softmax(self.model(input_ids=ids).logits[0, -1].float(), -1)
        k = body.get("top_logprobs") or body.get("logprobs") or 1
        top = torch.topk(logp, k if isinstance(k, int) else 1)
        tokens = [self.tokenizer.decode([int(i)]) for i in top.indices]
        answer = tokens[0] if self.answer is None else self.answer
        if path.endswith("/chat/completions"):
            lp = {"content": [{"token": answer, "logprob": top.values[0].item(),
                               "top_logprobs": [{"token": t, "logprob": v.item()}
                                                for t, v in zip(tokens, top.values)]}]}
            return {"choices": [{"message": {"role": "assistant", "content": answer},
                                 "logprobs": lp if self.logprobs else None}]}
        lp = {"tokens": [answer], "top_logprobs": [{t: v.item() for t, v in zip(tokens, top.values)}]}
        return {"choices": [{"text": answer, "logprobs": lp if self.logprobs and body.get("logprobs") else None}]}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def write_pairs(cfg, prompts, first, second) -> str:
    """A committed generate output holding these pairs (keys p000, p001, ...); returns its URL."""
    from rlaif.io import manifest
    from rlaif.io.shards import ShardWriter
    from rlaif.stages.common import context

    url = f"{cfg.storage.root}/{cfg.run_id}/generate"
    with ShardWriter(url, 5) as writer:
        for i, (p, a, b) in enumerate(zip(prompts, first, second)):
            writer.write({"__key__": f"p{i:03d}", "prompt.txt": p, "response_a.txt": a, "response_b.txt": b})
    # as this config's generate would have committed it: a stage refuses an upstream output of other settings
    manifest.write(url, stage="generate", run_id=cfg.run_id, config_hash=context(cfg, "generate").config_hash,
                   inputs={}, shards=writer.shards)
    return url
