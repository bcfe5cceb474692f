"""Generation with a KV cache against transformers (CPU torch, f32) on tiny checkpoints of the three families
(DeepSeek-V3 with MLA and YaRN, Mixtral, Qwen3-MoE with a dense layer among its MoE layers): greedy tokens equal
transformers' `generate` for prompts of different lengths batched together, stopping at the same end token; the
cached forward's logits equal the uncached forward's; the sampling filters equal transformers' logits warpers."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moejax.inference.generate import GenerateError, generate_ids  # noqa: E402
from moejax.inference.sampling import Sampling, filtered_logits  # noqa: E402
from moejax.interop import load_hf  # noqa: E402
from moejax.model.moe import exact_dispatch  # noqa: E402
from cpu_env import cpu_env  # noqa: E402
from test_hf_interop import VOCAB, _base, _perturbed_model  # noqa: E402

GENERATED = ("deepseek_v3", "mixtral", "qwen3_moe_mlp_only")
PROMPT_LENGTHS = (3, 11, 6)
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=GENERATED)
def imported(request, tmp_path_factory):
    """(family, transformers model, moejax model, config) of one family's tiny perturbed checkpoint."""
    hf_model = _perturbed_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory)
    model, cfg = load_hf(directory, base_config=_base())
    return request.param, hf_model, model, cfg


def _prompts(seed):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, VOCAB, n).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(hf_model, prompt, eos):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_generate(imported):
    """Batched prompts of lengths 3, 11 and 6 (right-padded together) give, token for token, what transformers
    generates for each alone; a row ends at the end token (included, as transformers returns it). The end token is
    chosen as a token greedy decoding emits for one prompt, so the stop is exercised, not only the cap."""
    name, hf_model, model, cfg = imported
    prompts = _prompts(1)
    free = generate_ids(model, prompts, max_new_tokens=NEW_TOKENS, max_positions=cfg.model.max_seq_len)
    assert free.finish == ["length"] * 3 and all(len(t) == NEW_TOKENS for t in free.tokens)
    eos = free.tokens[1][4]  # ends row 1 after 5 tokens (earlier where that token comes sooner)
    ours = generate_ids(model, prompts, max_new_tokens=NEW_TOKENS, stop_ids=[eos], max_positions=cfg.model.max_seq_len)
    reference = [_hf_greedy(hf_model, p, eos) for p in prompts]
    assert ours.tokens == reference, name
    assert ours.finish[1] == "stop" and ours.tokens[1][-1] == eos and len(ours.tokens[1]) <= 5
    assert [t[: len(r)] for t, r in zip(free.tokens, reference)] == reference


def test_cached_logits_equal_uncached_forward(imported):
    """Prefill of 7 positions, then 5 one-token steps: every position's logits equal the uncached forward's."""
    name, _, model, _ = imported
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, VOCAB, (2, 12)))
    with exact_dispatch():
        reference = nnx.jit(lambda m, t: m(t).logits_BxLxV)(model, tokens)
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    cache = model.empty_cache(2, 16)
    logits, cache = step(model, tokens[:, :7], jnp.broadcast_to(jnp.arange(7), (2, 7)), cache)
    pieces = [logits]
    for i in range(7, 12):
        logits, cache = step(model, tokens[:, i:i + 1], jnp.full((2, 1), i), cache)
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), np.asarray(reference), rtol=0, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 12, 0.5)])
def test_sampling_filters_equal_transformers_warpers(temperature, top_k, top_p):
    scores = np.random.RandomState(3).randn(4, VOCAB).astype(np.float32) * 3
    warped = torch.tensor(scores)
    for warper in (transformers.TemperatureLogitsWarper(temperature),
                   *([transformers.TopKLogitsWarper(top_k)] if top_k else []),
                   *([transformers.TopPLogitsWarper(top_p)] if top_p < 1 else [])):
        warped = warper(None, warped)
    ours = np.asarray(filtered_logits(jnp.asarray(scores), Sampling(temperature, top_k, top_p)))
    kept = np.isfinite(warped.numpy())
    assert np.array_equal(np.isfinite(ours), kept)
    np.testing.assert_allclose(ours[kept], warped.numpy()[kept], rtol=1e-6)


@pytest.mark.parametrize("imported", ["deepseek_v3"], indirect=True)  # the sampler does not depend on the family
def test_sampled_tokens_stay_in_the_filtered_set_and_follow_the_seed(imported):
    name, _, model, cfg = imported
    prompts = _prompts(4)
    sampling = Sampling(temperature=1.5, top_k=3)
    a = generate_ids(model, prompts, max_new_tokens=6, sampling=sampling, seed=11)
    assert a.tokens == generate_ids(model, prompts, max_new_tokens=6, sampling=sampling, seed=11).tokens
    assert a.tokens != generate_ids(model, prompts, max_new_tokens=6, sampling=sampling, seed=12).tokens
    # Every sampled token is among the top 3 of the uncached forward's logits at its position.
    for prompt, new in zip(prompts, a.tokens):
        seq = jnp.asarray([prompt + new])
        with exact_dispatch():
            logits = np.asarray(nnx.jit(lambda m, t: m(t).logits_BxLxV)(model, seq))[0]
        for i, token in enumerate(new):
            top3 = np.argsort(-logits[len(prompt) - 1 + i])[:3]
            assert token in top3, (name, i)


@pytest.mark.parametrize("imported", ["mixtral"], indirect=True)  # the request checks do not depend on the family
def test_requests_generation_cannot_serve(imported):
    _, _, model, cfg = imported
    limit = cfg.model.max_seq_len
    for prompts, kwargs, message in [
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1] * limit], {"max_positions": limit}, f"has {limit} tokens: the model has {limit} positions"),
        ([[1, VOCAB]], {}, f"token id {VOCAB} is outside the model's vocabulary of {VOCAB}"),
        ([[1, 2]], {"sampling": Sampling(top_p=0.0)}, "top_p must be in (0, 1]"),
    ]:
        with pytest.raises(GenerateError, match=message.replace("(", r"\(").replace("]", r"\]")):
            generate_ids(model, prompts, max_new_tokens=4, **kwargs)
    # A prompt near the end of the positions generates until them, then stops with finish "length".
    out = generate_ids(model, [[1] * (limit - 3)], max_new_tokens=10, max_positions=limit)
    assert out.finish == ["length"] and len(out.tokens[0]) == 3


CHARS = "abcdefghijklmnopqrstuvwxyz .,\n"


@pytest.fixture(scope="module")
def hf_dir_with_tokenizer(tmp_path_factory):
    """The tiny DeepSeek-V3 checkpoint with a character-level tokenizer.json (end token </s>, no BOS) beside it."""
    from tokenizers import Tokenizer, decoders, models

    directory = tmp_path_factory.mktemp("dsv3_tok")
    _perturbed_model("deepseek_v3").save_pretrained(directory)
    tok = Tokenizer(models.BPE(vocab={"</s>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}, merges=[],
                               unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_cli_expert_parallel_decode_equals_one_device(hf_dir_with_tokenizer, tmp_path, capsys):
    """moejax-generate on an 8-device mesh (data 2 x expert 4: the MoE layers through the expert-parallel dispatch)
    gives the tokens one device gives, and prints prompt and completion."""
    from moejax.cli.generate import main
    from moejax.data.tokenizer import load_tokenizer

    out = tmp_path / "out.json"
    prompts = ["the cat sat", "one two three four, five"]
    rc = main([str(hf_dir_with_tokenizer), "--prompt", prompts[0], "--prompt", prompts[1], "--max_new_tokens", "6",
               "--config.mesh.expert=4", "--config.mesh.data=2", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["mesh"]["expert"] == 4 and result["mesh"]["data"] == 2
    tok = load_tokenizer(str(hf_dir_with_tokenizer / "tokenizer.json"))
    model, cfg = load_hf(hf_dir_with_tokenizer, base_config=_base())
    one = generate_ids(model, [tok.encode_prompt(p).tolist() for p in prompts], max_new_tokens=6, stop_ids=[0],
                       max_positions=cfg.model.max_seq_len)
    assert [s["tokens"] for s in result["samples"]] == one.tokens
    printed = capsys.readouterr().out
    assert all(f"{p}\u2502" in printed for p in prompts)


def test_cli_bad_input_is_one_line_and_exit_2(hf_dir_with_tokenizer, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    long_prompt = "a" * 40  # the tiny model has 32 positions
    cases = [
        ([str(tmp_path / "nowhere"), "--prompt", "x"], "does not exist"),
        ([str(hf_dir_with_tokenizer), "--prompt", "x", "--tokenizer", "byte"],
         "tokenizer byte has 259 ids but the model's vocabulary is 96"),
        ([str(hf_dir_with_tokenizer), "--prompt_file", str(empty)], "holds no prompt"),
        ([str(hf_dir_with_tokenizer)], "no prompt"),
        ([str(hf_dir_with_tokenizer), "--prompt", long_prompt], "has 40 tokens: the model has 32 positions"),
    ]
    started = [subprocess.Popen([sys.executable, "-m", "moejax.cli.generate", *args], env=cpu_env(8),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args, _ in cases]
    for (args, message), proc in zip(cases, started):
        _, err = proc.communicate(timeout=300)
        errors = [line for line in err.splitlines() if "error" in line.lower()]  # notices aside
        assert proc.returncode == 2 and "Traceback" not in err, (args, err[-2000:])
        assert len(errors) == 1 and errors[0].startswith("moejax-generate: error: ") and message in errors[0], args
