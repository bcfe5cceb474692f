"""A moejax model for EleutherAI's lm-evaluation-harness (`lm_eval`, the optional `eval` extra), registered as
`moejax`. lm-eval 0.4 finds models only in its own table or where a module registered them, so the registration
happens on importing this module: `moejax-lm-eval` is lm-eval's command line with it imported
(`moejax-lm-eval run --model moejax --model_args pretrained=runs/tiny --tasks ...`), and in Python
`import moejax.inference.lm_eval_model` before `lm_eval.simple_evaluate(model="moejax", ...)`.

model_args: pretrained (a run's WORKDIR, WORKDIR/checkpoints/STEP, a weights or a Hugging Face directory),
tokenizer ("byte", a tokenizer.json; default: PRETRAINED/tokenizer.json where there is one, else byte when the
vocabulary fits), batch_size (rows per forward), max_length (default model.max_seq_len), max_gen_toks (default 256),
add_bos_token (default: where the tokenizer has one: documents start with it in training), dtype (the compute
dtype, e.g. float32), seed, and mesh axes as mesh_expert=4, mesh_data=2.

Requests, as lm-eval's own `hf` model serves them: loglikelihood scores the continuation's tokens after the context's
(encoded whole, then split, lm-eval's TemplateLM); loglikelihood_rolling scores a document in disjoint windows of
max_length (lm_eval.utils); generate_until generates (KV cache, moejax.inference.generate) until an `until` string or
the end token, greedy unless do_sample.
"""

from __future__ import annotations

import json

import lm_eval.models  # noqa: F401  (lm-eval fills its own model table only while it is empty: fill it before ours)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from moejax.data.tokenizer import TokenizerError, load_tokenizer
from moejax.inference.generate import generate_ids
from moejax.inference.load import load_for_inference
from moejax.inference.sampling import Sampling
from moejax.inference.scoring import score


# What lm-eval passes every model besides model_args: jax places the model on the mesh's devices itself, and batches
# have a fixed row count (batch_size), so these are accepted and not used.
_HARNESS_ARGS = ("device", "max_batch_size")


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("moejax")
class MoejaxLM(TemplateLM):
    def __init__(self, pretrained: str, tokenizer: str | None = None, batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool | str | None = None,
                 dtype: str | None = None, seed: int = 0, **more):
        super().__init__()
        from pathlib import Path

        overrides = {} if dtype is None else {"model.dtype": str(dtype)}
        for key, value in more.items():
            if key.startswith("mesh_"):
                overrides[f"mesh.{key[len('mesh_'):]}"] = int(value)
            elif key not in _HARNESS_ARGS:
                raise ValueError(f"moejax model_args: unknown argument {key!r}")
        self.loaded = load_for_inference(pretrained, overrides)  # emulates the config's mesh on a CPU-only machine
        vocab = int(self.loaded.cfg.model.vocab_size)
        if tokenizer is None:
            beside = Path(pretrained) / "tokenizer.json"
            tokenizer = str(beside) if beside.is_file() else "byte"
        self.tok = load_tokenizer(tokenizer)
        if self.tok.vocab_size > vocab:
            raise TokenizerError(f"tokenizer {self.tok.name} has {self.tok.vocab_size} ids, more than the model's "
                                 f"vocabulary of {vocab}")
        self.batch_rows = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" picks the default
        self.max_length = int(max_length or self.loaded.cfg.model.max_seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos = (self.tok.bos_id is not None) if add_bos_token is None else _flag(add_bos_token)
        self.seed = int(seed)

    # ---------------------------------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.tok.encode(string).tolist()
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        return ([self.tok.bos_id] if bos and self.tok.bos_id is not None else []) + ids

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    # ------------------------------------------------------------------------------------- requests

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request; the
        context is cut from the left to fit max_length."""
        sequences, n_cont = [], []
        for _, context_enc, continuation_enc in requests:
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            sequences.append(whole)
            n_cont.append(len(continuation_enc))
        scored = score(self.loaded.model, sequences, mesh=self.loaded.mesh, batch_rows=self.batch_rows)
        results = []
        for (key, _, _), s, n in zip(requests, scored, n_cont):
            answer = (float(s.logprobs[-n:].sum()), bool(s.greedy[-n:].all()))
            results.append(answer)
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in (r.args for r in requests):
            windows = [(None, *w) for w in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation arguments are generated together, in batches of batch_size."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sample = _flag(kwargs.pop("do_sample", False))
            sampling = Sampling(float(kwargs.pop("temperature", 1.0)) if sample else 0.0,
                                int(kwargs.pop("top_k", 0) or 0), float(kwargs.pop("top_p", 1.0) or 1.0))
            for start in range(0, len(indices), self.batch_rows):
                batch = indices[start:start + self.batch_rows]
                prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] or [self.prefix_token_id]
                           for i in batch]
                gen = generate_ids(self.loaded.model, prompts, max_new_tokens=max_new, sampling=sampling,
                                   stop_ids=[self.eot_token_id], seed=self.seed, mesh=self.loaded.mesh,
                                   max_positions=self.max_length)
                for i, ids in zip(batch, gen.tokens):
                    text = self.tok.decode([t for t in ids if t != self.eot_token_id])
                    for stop in until:
                        if stop and stop in text:
                            text = text[: text.index(stop)]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out
