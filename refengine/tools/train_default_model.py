"""Train the embedded default model: a small Qwen3-Next hybrid with an MTP head, on a 2-core CPU.

    python -m refengine.tools.train_default_model --out refengine/data/default_model [--steps N] [--seed 0]

About 13 minutes on a busy 2-core CPU with one torch thread (deterministic: the same interpreter
and torch build regenerate the same bytes).

The corpus is built offline (refengine.tools.corpus). The model is ``Qwen3NextForCausalLM`` itself,
trained through the dense forward of ``refengine.tools.training``: next-byte cross-entropy for the
main model plus, for each of ``mtp_steps`` chained MTP steps, cross-entropy against the main
model's own (detached) next-token distribution at the position the draft stands for, which is
what greedy verification compares the draft with. The result is written in the Hugging Face
Qwen3-Next layout (in_proj_qkvz / in_proj_ba, tied embeddings) plus ``mtp.*`` tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from refengine.model.qwen3_next.config import FULL, LINEAR, Qwen3NextConfig
from refengine.model.qwen3_next.model import Qwen3NextForCausalLM
from refengine.model.qwen3_next.weights import merge_ba, merge_qkvz
from refengine.tokenizer import write_byte_tokenizer
from refengine.tools import corpus
from refengine.tools import training as tr
from refengine.tools.errors import OneLineParser, int_at_least

EOS_ID = 256  # ids 0..255 are bytes
VOCAB_SIZE = 260  # bytes, EOS and three unused ids


@dataclass(frozen=True)
class TrainSpec:
    hidden_size: int = 128
    layer_types: tuple[str, ...] = (LINEAR, LINEAR, LINEAR, FULL)
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 32
    steps: int = 900
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.05
    mtp_steps: int = 3  # chained MTP steps trained (drafts 1..mtp_steps)
    mtp_weight: float = 0.5
    synthetic_fraction: float = 0.25
    seed: int = 0
    threads: int = 1  # one thread: deterministic, and no barrier stalls on a busy machine


TINY = TrainSpec(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_head_dim=16,
                 layer_types=(LINEAR, FULL), batch_size=2, seq_len=64, warmup=1)


def hf_config(spec: TrainSpec) -> dict:
    """config.json for transformers' Qwen3NextForCausalLM (all-dense); the MTP is counted from mtp.*."""
    n = len(spec.layer_types)
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "dtype": "float32",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": n,
        "layer_types": list(spec.layer_types),
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_head_dim,
        "linear_value_head_dim": spec.linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "num_experts": 0,
        "mlp_only_layers": list(range(n)),
        "num_nextn_predict_layers": 1,
        "bos_token_id": None,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
    }


def build_model(spec: TrainSpec) -> Qwen3NextForCausalLM:
    cfg = Qwen3NextConfig.from_hf_config(hf_config(spec))
    model = Qwen3NextForCausalLM(cfg)
    gen = torch.Generator().manual_seed(spec.seed)
    depth = 2 * (len(spec.layer_types) + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("conv1d.weight"):
                p.uniform_(-0.5, 0.5, generator=gen)
            elif name.endswith("A_log"):
                p.uniform_(math.log(0.05), math.log(4.0), generator=gen)  # per-token decay 0.94 .. 0.005
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()  # zero-centred RMSNorm weights
            elif name == "model.embed_tokens.weight":
                p.normal_(0.0, 0.05, generator=gen)
            else:
                std = p.shape[1] ** -0.5
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(depth)
                p.normal_(0.0, std, generator=gen)
    return model


def encode_corpus(spec: TrainSpec, max_files: int | None = None) -> torch.Tensor:
    """The corpus as one int16 token stream, every document followed by EOS."""
    ids: list[int] = []
    docs = corpus.build_documents(
        seed=spec.seed, synthetic_fraction=spec.synthetic_fraction, max_files=max_files
    )
    for doc in docs:
        ids.extend(doc.encode("ascii"))
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int16)


def losses(model: Qwen3NextForCausalLM, batch: torch.Tensor, mtp_steps: int) -> tuple[torch.Tensor, list]:
    """Main next-token cross-entropy and one MTP loss per chained step, for ``batch`` [B, T]."""
    hidden = tr.hidden_states(model, batch)
    logits = tr.logits(model, hidden)  # [B, T, V]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
    teacher = torch.softmax(logits.detach(), dim=-1)
    mtp_losses = []
    for s, out in enumerate(tr.mtp_hidden_chain(model, batch, hidden, mtp_steps)):
        # Row t of step s drafts token t+s+2, which the main model predicts at position t+s+1.
        n = batch.shape[1] - 2 - s
        draft_logits = tr.logits(model, out[:, :n])
        mtp_losses.append(F.cross_entropy(draft_logits.reshape(-1, VOCAB_SIZE),
                                          teacher[:, s + 1: s + 1 + n].reshape(-1, VOCAB_SIZE)))
    return main, mtp_losses


def train(spec: TrainSpec, data: torch.Tensor, log=print) -> Qwen3NextForCausalLM:
    torch.manual_seed(spec.seed)
    model = build_model(spec)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(spec.seed + 1)
    start = time.perf_counter()
    for step in range(1, spec.steps + 1):
        lr = spec.lr * min(1.0, step / spec.warmup) * (0.55 + 0.45 * math.cos(math.pi * step / spec.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - spec.seq_len, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[o: o + spec.seq_len] for o in offsets.tolist()]).long()
        main, mtp = losses(model, batch, spec.mtp_steps)
        loss = main + spec.mtp_weight * sum(mtp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step in (1, spec.steps):
            elapsed = time.perf_counter() - start
            tok_s = step * spec.batch_size * spec.seq_len / elapsed
            eta = elapsed / step * (spec.steps - step)
            mtp_txt = " ".join(f"{m.item():.3f}" for m in mtp)
            log(f"step {step}/{spec.steps} loss {main.item():.3f} mtp [{mtp_txt}] lr {lr:.2e} "
                f"{tok_s:.0f} tok/s elapsed {elapsed:.0f}s eta {eta:.0f}s")
    model.requires_grad_(False)
    return model.eval()


def checkpoint_tensors(model: Qwen3NextForCausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters in the on-disk Qwen3-Next layout (tied lm_head left out)."""
    cfg = model.config
    state = {
        k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
    }
    for i in cfg.linear_layer_ids:
        p = f"model.layers.{i}.linear_attn."
        state[p + "in_proj_qkvz.weight"] = merge_qkvz(state.pop(p + "in_proj_qkv.weight"),
                                                      state.pop(p + "in_proj_z.weight"), cfg)
        state[p + "in_proj_ba.weight"] = merge_ba(state.pop(p + "in_proj_b.weight"),
                                                  state.pop(p + "in_proj_a.weight"), cfg)
        state[p + "conv1d.weight"] = state[p + "conv1d.weight"].unsqueeze(1).contiguous()
    return state


def save(model: Qwen3NextForCausalLM, spec: TrainSpec, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2) + "\n")
    write_byte_tokenizer(out, VOCAB_SIZE, EOS_ID)
    save_file(checkpoint_tensors(model), out / "model.safetensors", metadata={"format": "pt"})


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m refengine.tools.train_default_model", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output folder (config.json, model.safetensors)")
    p.add_argument(
        "--steps", type=int_at_least(1), default=None, help=f"training steps (default {TrainSpec.steps})"
    )
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch (for smoke tests)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch intra-op threads (default 1)")
    p.add_argument("--max-files", type=int_at_least(1), default=None,
                   help="read only this many stdlib files (smoke tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spec = replace(TINY if args.tiny else TrainSpec(), seed=args.seed)
    if args.steps is not None:
        spec = replace(spec, steps=args.steps)
    if args.threads is not None:
        spec = replace(spec, threads=args.threads)
    torch.set_num_threads(spec.threads)
    torch.set_flush_denormal(True)  # decays underflow; denormal arithmetic is slow
    print(f"spec: {json.dumps(asdict(spec))}", flush=True)
    start = time.perf_counter()
    data = encode_corpus(spec, args.max_files)
    print(f"corpus: {len(data)} tokens ({time.perf_counter() - start:.1f}s)", flush=True)
    model = train(spec, data, log=lambda line: print(line, flush=True))
    save(model, spec, args.out)
    params = sum(t.numel() for t in checkpoint_tensors(model).values())
    print(f"wrote {args.out} ({params} parameters) in {time.perf_counter() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
