"""EAGLE-1 / EAGLE-3 heads: their math against a plain-torch computation written from vLLM 0.33's facts, the
loader's refusals, the drafter's aux ids, and both engines token- and acceptance-exact with each method."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from refengine import LLM, SamplingParams
from refengine.forward_context import AttnMetadata
from refengine.llm import default_model_path
from refengine.model.eagle import EagleHeadError, cache_key, default_aux_layer_ids, load_eagle_head
from refengine.model.loader import load_model
from refengine.tools.eagle_head import add_eagle_head


@pytest.fixture(scope="module")
def target():
    net, cfg = load_model(default_model_path(), dtype=torch.float32, device="cpu")
    return net, cfg


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-heads")
    src = default_model_path()
    add_eagle_head(src, root / "eagle", "eagle", seed=3)
    add_eagle_head(src, root / "eagle3", "eagle3", draft_vocab_size=180, seed=4)
    return {"eagle": str(root / "eagle"), "eagle3": str(root / "eagle3")}


# ---- the plain-torch oracle (one sequence, causal attention, no paging) -----------------------------------
def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):  # x [T, heads, D], NeoX halves
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _attend(t, p, x, pos, cfg):  # x [T, in]
    hq, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).view(-1, hq, d), pos)
    k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).view(-1, hk, d), pos)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(-1, hk, d)
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    n = x.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, hq * d)
    return o @ t[p + "self_attn.o_proj.weight"].T


def _mlp(t, p, x):
    g, u = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ t[p + "mlp.down_proj.weight"].T


def oracle_eagle1(t, cfg, embed, lm_head, ids, hidden, pos):
    """vLLM llama_eagle: fc(cat(emb, h)); layer 0 without input norm; h + residual; the target's lm_head."""
    x = torch.cat([embed[ids], hidden], -1) @ t["fc.weight"].T
    residual = x
    a = _attend(t, "layers.0.", x, pos, cfg)
    residual = a + residual
    out = _mlp(t, "layers.0.", _rms(residual, t["layers.0.post_attention_layernorm.weight"])) + residual
    return out, (out @ lm_head.T).argmax(-1)


def oracle_eagle3(t, cfg, embed, ids, hidden, pos):
    """vLLM llama_eagle3: cat(input_layernorm(emb), hidden_norm(h)), residual h; norm; lm_head; d2t."""
    p = "midlayer."
    e = _rms(embed[ids], t[p + "input_layernorm.weight"])
    a = _attend(t, p, torch.cat([e, _rms(hidden, t[p + "hidden_norm.weight"])], -1), pos, cfg)
    residual = a + hidden
    prenorm = _mlp(t, p, _rms(residual, t[p + "post_attention_layernorm.weight"])) + residual
    draft = (_rms(prenorm, t["norm.weight"]) @ t["lm_head.weight"].T).argmax(-1)
    return prenorm, draft + t["d2t"][draft]


def _paged(n: int, block_size: int = 4):
    blocks = math.ceil(n / block_size)
    return AttnMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                        seq_lens=torch.tensor([n], dtype=torch.int32),
                        block_table=torch.arange(blocks, dtype=torch.int32)[None],
                        slot_mapping=torch.arange(n, dtype=torch.int64))


def _kv(head, blocks: int = 8, block_size: int = 4):
    c = head.config
    return {cache_key(0): tuple(torch.zeros(blocks, block_size, c.num_key_value_heads, c.head_dim)
                                for _ in range(2))}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_math_matches_a_plain_torch_computation(method, heads, target):
    net, cfg = target
    head, ids_aux = load_eagle_head(heads[method], method, net, cfg)
    t = load_file(f"{heads[method]}/model.safetensors")
    hcfg = json.loads(Path(heads[method], "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    n = 11
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
    pos = torch.arange(n)
    embed = net.model.embed_tokens.weight.detach()
    if method == "eagle":
        hidden = torch.randn(n, 128, generator=gen)
        want_h, want_d = oracle_eagle1(t, hcfg, embed, net.lm_head.weight.detach(), ids, hidden, pos)
        first = head.first_hidden(hidden, None)
    else:
        assert ids_aux == (1, 2, 3)
        aux = torch.randn(n, 3 * 128, generator=gen)
        first = head.first_hidden(None, aux)
        torch.testing.assert_close(first, aux @ t["fc.weight"].T, rtol=1e-5, atol=1e-5)
        want_h, want_d = oracle_eagle3(t, hcfg, embed, ids, first, pos)
    for_logits, for_chain = head(ids, first, pos, _paged(n), _kv(head))
    torch.testing.assert_close(for_chain, want_h, rtol=1e-4, atol=1e-4)
    assert head.draft(for_logits).tolist() == want_d.tolist()
    if method == "eagle3":  # d2t moved the ids: some draft differs from its raw lm_head argmax
        raw = head.lm_head(for_logits).argmax(-1)
        assert (raw != head.draft(for_logits)).any()


def _variant(src: str, dst, *, drop=(), add=None, config=None):
    dst.mkdir()
    t = load_file(f"{src}/model.safetensors")
    for name in drop:
        t.pop(name)
    t.update(add or {})
    save_file(t, str(dst / "model.safetensors"))
    c = json.loads(Path(src, "config.json").read_text())
    c.update(config or {})
    (dst / "config.json").write_text(json.dumps(c))
    return str(dst)


@pytest.mark.parametrize("method,change,message", [
    ("eagle", {"add": {"norm.weight": torch.ones(128)}}, "'norm.weight' on disk: an EAGLE-1 head has no"),
    ("eagle", {"add": {"layers.0.input_layernorm.weight": torch.ones(128)}}, "first layer has no input norm"),
    ("eagle", {"add": {"lm_head.weight": torch.zeros(260, 128)}}, "uses the target's lm_head"),
    ("eagle3", {"config": {"draft_vocab_size": 260}, "add": {"lm_head.weight": torch.zeros(260, 128)}},
     "a full draft vocabulary has no d2t"),
    ("eagle3", {"drop": ("d2t",)}, "has no 'd2t'"),
    ("eagle3", {"config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, r"fc.weight is \[128, 384\] but"),
    ("eagle3", {"config": {"eagle_aux_hidden_state_layer_ids": None}}, "vLLM's default ids for a 4-layer"),
    ("eagle3", {"config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, r"id\(s\) \[4\] at or past"),
])
def test_loader_refuses_what_vllm_refuses(method, change, message, heads, target, tmp_path):
    net, cfg = target
    path = _variant(heads[method], tmp_path / "head", **change)
    with pytest.raises(EagleHeadError, match=message):
        load_eagle_head(path, method, net, cfg)


def test_default_aux_ids_collapse_on_short_targets():
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(4) == (1, 2) and default_aux_layer_ids(5) == (2,)
    assert default_aux_layer_ids(6) == (2, 3)


PROMPTS = [list(range(5, 40)), list(range(100, 117)), [7, 8, 9] * 7, list(range(200, 206))]


def _run(engine, graph_mode, k, method, head, records=None, **kw):
    llm = LLM(engine=engine, graph_mode=graph_mode, num_speculative_tokens=k, drafter=method,
              draft_model=head, max_num_batched_tokens=24,
              observer=None if records is None else records.append, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def _per_request(records):
    """request -> [(drafts verified, kept count, drafter inputs, next drafts)] over its verify rows."""
    out: dict = {}
    for step in records:
        for r in step.rows:
            if r.num_accepted is not None:
                out.setdefault(r.request_id, []).append(
                    (r.draft_token_ids, r.num_accepted, r.drafter_input_ids, r.next_draft_token_ids))
    return {rid: rows[:-1] for rid, rows in out.items()}  # the last row: it may have finished there


MODES = ("none", "piecewise", "full", "full_and_piecewise")
DEFAULT_CASES = {("eagle3", 3, "full_and_piecewise"), ("eagle", 1, "full")}
ENGINE_CASES = [(m, k, mode) for m in ("eagle", "eagle3") for k in (1, 3) for mode in MODES]


@pytest.fixture(scope="module")
def reference_runs(heads):
    """(method, K) -> (the reference engine's outputs, its verify rows per request), made once each."""
    memo: dict = {}

    def get(method: str, k: int):
        if (method, k) not in memo:
            records: list = []
            outs = _run("reference", "none", k, method, heads[method], records)
            memo[method, k] = outs, _per_request(records)
        return memo[method, k]

    return get


@pytest.fixture(scope="module")
def plain_outputs():
    return _run("reference", "none", 0, "mtp", None)


@pytest.mark.parametrize("method,k,mode", [
    pytest.param(*c, id="-".join(map(str, c)), marks=[] if c in DEFAULT_CASES else [pytest.mark.slow])
    for c in ENGINE_CASES])
def test_engines_token_and_acceptance_exact(method, k, mode, heads, reference_runs, plain_outputs):
    """The async engine in each graph mode against the reference engine (drafts verified, kept counts,
    drafter inputs, next drafts, row by row) and both against plain decoding."""
    ref_outs, want = reference_runs(method, k)
    assert ref_outs == plain_outputs
    assert any(n for rows in want.values() for _, n, _, _ in rows), "some drafts are accepted"
    records: list = []
    assert _run("async", mode, k, method, heads[method], records) == plain_outputs
    assert _per_request(records) == want


def test_speculative_config_is_vllms_spelling(heads):
    spec = {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 2}
    llm = LLM(speculative_config=spec)
    s = llm.config.speculative
    assert (s.drafter, s.draft_model, s.num_speculative_tokens) == ("eagle3", heads["eagle3"], 2)
    with pytest.raises(ValueError, match="both given"):
        LLM(speculative_config=spec, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="unknown key"):
        LLM(speculative_config={**spec, "draft_tensor_parallel_size": 1})


def test_prefix_cache_drops_the_last_matched_block(heads):
    """vLLM's rule for drafters that keep KV: with an EAGLE head a repeated prompt hits one block less than
    without a drafter; MTP's keys cover one token more instead."""
    prompt = list(range(10, 37))  # 27 tokens, blocks of 4: 6 full blocks before the last token
    counts = {}
    for name, kw in (("plain", {}), ("eagle3", {"num_speculative_tokens": 2, "drafter": "eagle3",
                                                "draft_model": heads["eagle3"]})):
        llm = LLM(block_size=4, enable_prefix_caching=True, mamba_cache_mode="all", **kw)
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        llm.generate([prompt], params)
        counts[name] = llm.generate([prompt], params)[0].num_cached_tokens
    assert counts == {"plain": 24, "eagle3": 20}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_engines_exact_on_nemotron_h(method, tmp_path):
    """The other family: Mamba2 + attention + MoE blocks, the aux states taken between blocks."""
    from refengine.tools.tiny_models import tiny_model_path

    head, model = tmp_path / "head", tiny_model_path("tiny:nemotron_h")
    add_eagle_head(model, head, method, draft_vocab_size=200 if method == "eagle3" else None)
    plain = _run("reference", "none", 0, "mtp", None, model=model)
    ref_records, records = [], []
    assert _run("reference", "none", 3, method, str(head), ref_records, model=model) == plain
    got = _run("async", "full_and_piecewise", 3, method, str(head), records, model=model)
    assert got == plain
    assert _per_request(records) == _per_request(ref_records)


@pytest.mark.slow
def test_the_tiny_eagle3_preset_is_trained():
    """``tiny:eagle3``'s head beats an untrained one on the model's greedy text (mean acceptance length)."""
    from refengine.tools.eagle_training import mean_acceptance_length
    from refengine.tools.tiny_models import tiny_head_path, tiny_model_path

    preset = "tiny:eagle3"
    trained = mean_acceptance_length(tiny_model_path(preset), tiny_head_path(preset), "eagle3", 3)
    assert trained > 1.5, trained


def test_add_eagle_head_command(tmp_path, capsys):
    from refengine.tools.cli import main

    dst = tmp_path / "head"
    assert main(["add-eagle-head", default_model_path(), str(dst), "--aux-ids", "0,3",
                 "--draft-vocab-size", "100"]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 3] and config["draft_vocab_size"] == 100
    assert load_file(str(dst / "model.safetensors"))["fc.weight"].shape == (128, 256)
    assert main(["add-eagle-head", default_model_path(), str(dst)]) != 0  # DST exists: refused, named
    assert "exists" in capsys.readouterr().err


def test_loader_takes_vllms_spellings_and_a_shipped_embedding(heads, target, tmp_path):
    """A ``model.`` prefix and an ``fc.bias`` are dropped as vLLM's loader drops them; an EAGLE-1 head that
    ships ``embed_tokens.weight`` embeds with its own copy (the target's otherwise)."""
    net, cfg = target
    t = load_file(f"{heads['eagle']}/model.safetensors")
    own = torch.randn(260, 128)
    renamed = {f"model.{k}": v for k, v in t.items()}
    renamed |= {"fc.bias": torch.zeros(128), "embed_tokens.weight": own}
    path = _variant(heads["eagle"], tmp_path / "head", drop=tuple(t), add=renamed)
    head, _ = load_eagle_head(path, "eagle", net, cfg)
    ids = torch.tensor([3, 5])
    torch.testing.assert_close(head.embed(ids), own[ids])
    plain, _ = load_eagle_head(heads["eagle"], "eagle", net, cfg)
    torch.testing.assert_close(plain.embed(ids), net.model.embed_tokens(ids))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_training_forward_is_the_engines(method, heads, target):
    """What ``eagle_training`` fits is what the engine runs: the first pass over a sequence and a chained
    pass at the last row, through the head's paged KV cache, give the dense training forward's logits."""
    from refengine.tools.eagle_training import chain_logits, target_states

    net, cfg = target
    head, aux = load_eagle_head(heads[method], method, net, cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    states = target_states(net, ids, aux)
    want = chain_logits(head, ids, states, 2)
    n, kv = 9, _kv(head)

    def logits(h):
        return head.lm_head(h).float() if method == "eagle3" else net.compute_logits(h)

    first, chained = head(ids[0, 1: n + 1], head.first_hidden(states[0, :n], states[0, :n]), torch.arange(n),
                          _paged(n), kv)
    torch.testing.assert_close(logits(first), want[0][0], rtol=1e-4, atol=1e-4)
    t = n - 1
    attn = AttnMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([t + 2], dtype=torch.int32),
                        torch.arange(3, dtype=torch.int32)[None], torch.tensor([t + 1]))
    second, _ = head(ids[0, t + 2: t + 3], chained[t: t + 1], torch.tensor([t + 1]), attn, kv)
    torch.testing.assert_close(logits(second), want[1][0, t: t + 1], rtol=1e-4, atol=1e-4)
