"""Train deepinfer-tiny-moe, a DeepSeek-V3-architecture model, offline, on the repository's text.

    python snippets/models/train_tiny_moe.py                       # the shipped run (2 cores)
    python snippets/models/train_tiny_moe.py --max-minutes 1 --out /tmp/moe   # a dry run

Reproducing: the shipped run is the first command above; on the same machine type and
library versions (records.json names them) it writes the same model.safetensors byte for
byte. A short check of that, which takes minutes rather than the whole run:

    python snippets/models/train_tiny_moe.py --steps 8 --out /tmp/a
    python snippets/models/train_tiny_moe.py --steps 8 --out /tmp/b
    sha256sum /tmp/[ab]/deepinfer-tiny-moe/model.safetensors      # the same twice

What it writes (under --out, default snippets/models):

    deepinfer-tiny-moe/   DeepseekV3ForCausalLM, float16, with one multi-token prediction
                          (MTP) module stored as layer num_hidden_layers, as DeepSeek stores it
    records.json          its figures under models["deepinfer-tiny-moe"]; other entries kept
    RECORDS.md            its section at the end; the sections before it kept

Why: chapters 4 and 5 run the engine on DeepSeek's architecture. Random experts route
tokens at random, so their skew says nothing; these experts are trained, so the load the
demos show is the load of a model that learned something. The MTP module is trained with
the MTP loss, so its drafts can be accepted for a reason.

What is DeepSeek's: MLA (low-rank queries and a 64-wide latent), 16 routed experts in 4
groups with group-limited top-4 routing and one shared expert, the first layer dense,
sigmoid router scores, and auxiliary-loss-free balancing: after every step each expert's
routing bias moves by a fixed amount towards balance (up if it took fewer tokens than the
mean, down otherwise). The bias only chooses experts; it never weighs their outputs.

Same data as deepinfer-tiny (snippets/models/train_tiny.py): the corpus at the pinned
commit, the same held-out files, and deepinfer-tiny's tokenizer as shipped (checked
against its recorded sha256). Same reproducibility rules: everything seeded, 2 threads, a
fixed number of steps; two runs on one machine write byte-identical weights.

The training split is small (about 93k tokens), so 300 steps of 16 x 256 tokens already
pass over it about 13 times (an earlier 700-step run passed 31 times and fit the training
files far better than the held-out ones). The routing biases move twice as fast as the V3
report's 0.001, so that the load evens out within those 300 steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Idle OpenMP threads sleep rather than spin. On a busy machine a spinning thread holds a
# core the other thread needs, and a step took 7 times as long; the sums are the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import train_tiny as base  # noqa: E402  (sets the offline environment before transformers)
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from torch import nn  # noqa: E402

NAME = "deepinfer-tiny-moe"
SEED = 4321
MARKER = "<!-- deepinfer-tiny-moe: written by train_tiny_moe.py -->"


@dataclass
class MoESpec:
    hidden_size: int = 256
    intermediate_size: int = 384  # the dense first layer's MLP
    moe_intermediate_size: int = 32  # one expert's MLP
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    n_group: int = 4
    topk_group: int = 2
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.5
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0


@dataclass
class MoETraining(base.TrainSpec):
    mtp_weight: float = (
        0.3  # lambda of the V3 report's MTP loss (its value for the first 10T tokens)
    )
    bias_update_speed: float = 1e-3  # gamma: how far a routing bias moves per step


SPEC = MoESpec()
TRAINING = MoETraining(steps=300, warmup_steps=30, dropout=0.2, bias_update_speed=2e-3)


# ---------------------------------------------------------------- model


def build_config(spec: MoESpec, vocab_size: int, eot: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        **{k: v for k, v in asdict(spec).items() if k != "rope_theta"},
        num_key_value_heads=spec.num_attention_heads,  # unused by MLA; kept consistent
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rope_interleave=True,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )


class MTPModule(nn.Module):
    """One MTP module, as the V3 report draws it and DeepSeek's checkpoints name it:
    the main model's hidden state at position i and the embedding of token i+1, each
    normalised, are concatenated (embedding first, as the released eh_proj expects) and
    projected back to the model's width; one decoder block runs over that; shared_head's
    norm and the main model's output head give the logits of token i+2. The embedding and
    the head are the main model's."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        width, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(width, eps)
        self.hnorm = DeepseekV3RMSNorm(width, eps)
        self.eh_proj = nn.Linear(2 * width, width, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(width, eps)

    def forward(self, hidden, next_embeds, position_embeddings) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x = self.block(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.shared_head.norm(x)

    def checkpoint_tensors(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """model.layers.{layer_idx}.*, named as transformers saves a decoder layer: the
        block's tensors flat beside the rest, and one set of matrices per expert."""
        out = {}
        for name, t in self.state_dict().items():
            name = f"model.layers.{layer_idx}.{name.removeprefix('block.')}"
            out.update(per_expert(name, t.detach()))
        return out


def per_expert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' stacked experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]
    as the per-expert gate_proj, up_proj and down_proj of its checkpoints."""
    prefix, stacked = name.rsplit(".", 1)
    if not prefix.endswith(".experts"):
        return {name: t.clone()}
    if stacked == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": m.clone() for e, m in enumerate(t)}
    out = {}
    for e, m in enumerate(t):
        gate, up = m.chunk(2)
        out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
        out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
    return out


class TinyMoE(nn.Module):
    """The transformers model and its MTP module, trained together."""

    def __init__(self, spec: MoESpec, vocab_size: int, eot: int) -> None:
        super().__init__()
        from transformers import DeepseekV3ForCausalLM

        self.lm = DeepseekV3ForCausalLM(build_config(spec, vocab_size, eot))
        # One expert at a time (the MTP block shares the config): the default grouped
        # matmul's backward sums a token's top-k gradients in an order that varies
        # between runs on 2 threads, and two runs would not write the same weights.
        self.lm.set_experts_implementation("eager")
        self.mtp = MTPModule(self.lm.config, spec.num_hidden_layers)
        self.mtp.apply(self.lm._init_weights)  # transformers' init; experts start uninitialised

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of tokens i+1 (main model) and i+2 (MTP), for x: [batch, length]."""
        inner = self.lm.model
        hidden = inner(input_ids=x, use_cache=False).last_hidden_state  # after the final norm
        positions = torch.arange(x.shape[1] - 1)[None]
        rope = inner.rotary_emb(hidden, positions)
        mtp = self.mtp(hidden[:, :-1], inner.embed_tokens(x[:, 1:]), rope)
        return self.lm.lm_head(hidden), self.lm.lm_head(mtp)

    def routers(self) -> list[nn.Module]:
        blocks = [*self.lm.model.layers, self.mtp.block]
        return [b.mlp.gate for b in blocks if hasattr(b.mlp, "gate")]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- balancing


class LoadMeter:
    """Tokens each router sent to each expert, counted from the routers' own outputs."""

    def __init__(self, routers: list[nn.Module], num_experts: int) -> None:
        self.counts = torch.zeros(len(routers), num_experts, dtype=torch.long)
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, i: int):
        def record(module, args, out) -> None:
            ids = out[2]  # (router_logits, weights, expert ids)
            self.counts[i] += torch.bincount(ids.flatten(), minlength=self.counts.shape[1])

        return record

    def take(self) -> torch.Tensor:
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def max_violation(counts: torch.Tensor) -> list[float]:
    """Per router: the busiest expert's load over the mean load, minus 1 (0 is perfect)."""
    c = counts.double()
    return [round(v, 4) for v in (c.max(-1).values / c.mean(-1) - 1).tolist()]


@torch.no_grad()
def update_biases(routers: list[nn.Module], counts: torch.Tensor, speed: float) -> None:
    """Auxiliary-loss-free balancing: raise the bias of every expert that took fewer tokens
    than the mean this step, and lower the others', by the same small amount."""
    for router, c in zip(routers, counts.double()):
        router.e_score_correction_bias += speed * torch.sign(c.mean() - c).float()


# ---------------------------------------------------------------- training


def add_dropout(model: TinyMoE, p: float) -> list:
    """base.add_dropout on the main model, and the same on the MTP block's branches."""
    hooks = base.add_dropout(model.lm, p)
    if p > 0:
        block = model.mtp.block

        def drop(module, args, out):
            if isinstance(out, tuple):
                return (F.dropout(out[0], p, module.training), *out[1:])
            return F.dropout(out, p, module.training)

        hooks += [m.register_forward_hook(drop) for m in (block.self_attn, block.mlp)]
    return hooks


def train(
    model: TinyMoE, stream: torch.Tensor, spec: MoETraining, seed: int, deadline: float | None
) -> dict:
    """base.train's loop, plus the MTP loss and the routing-bias update after each step."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    hooks = add_dropout(model, spec.dropout)
    routers = model.routers()
    meter = LoadMeter(routers, SPEC.n_routed_experts)
    opt = base.make_optimizer(model, spec)
    model.train()
    history, start = [], time.perf_counter()
    losses, mtp_losses, interval_counts = [], [], torch.zeros_like(meter.counts)
    steps_done, stopped_early = 0, False
    for step in range(spec.steps):
        if deadline is not None and time.perf_counter() > deadline:
            stopped_early = True
            break
        starts = torch.randint(0, len(stream) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + spec.seq_len + 1] for s in starts.tolist()])
        x, y = batch[:, :-1], batch[:, 1:]
        for group in opt.param_groups:
            group["lr"] = base.lr_at(step, spec)
        logits, mtp_logits = model(x)
        lm = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        mtp = F.cross_entropy(mtp_logits.flatten(0, 1), y[:, 1:].flatten())
        loss = lm + spec.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        counts = meter.take()
        update_biases(routers, counts, spec.bias_update_speed)
        interval_counts += counts
        losses.append(lm.item())
        mtp_losses.append(mtp.item())
        steps_done = step + 1
        if steps_done % spec.log_every == 0 or steps_done == spec.steps:
            minutes = (time.perf_counter() - start) / 60
            row = {
                "step": steps_done,
                "train_loss": round(sum(losses) / len(losses), 4),
                "mtp_loss": round(sum(mtp_losses) / len(mtp_losses), 4),
                "max_violation": max_violation(interval_counts),
                "lr": round(base.lr_at(step, spec), 6),
                "elapsed_min": round(minutes, 1),
            }
            history.append(row)
            losses, mtp_losses, interval_counts = [], [], torch.zeros_like(interval_counts)
            base.log(
                f"  step {steps_done:5d}  loss {row['train_loss']:.4f}  mtp {row['mtp_loss']:.4f}"
                f"  maxvio {row['max_violation']}  {minutes:5.1f} min"
            )
    for h in hooks:
        h.remove()
    meter.remove()
    model.eval()
    return {
        "steps_planned": spec.steps,
        "steps_done": steps_done,
        "stopped_early": stopped_early,
        "minutes": round((time.perf_counter() - start) / 60, 2),
        "log": history,
    }


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def mtp_agreement(model: TinyMoE, wins: list[torch.Tensor]) -> dict:
    """Teacher-forced over the held-out windows: how often the MTP module's greedy token
    for position i+2 equals the main model's greedy token for position i+2 (predicted one
    step later, from the true text up to i+1), and how often each is the true token."""
    same = mtp_right = main_right = n = 0
    for win in wins:
        x, y = win[None, :-1], win[None, 1:]
        logits, mtp_logits = model(x)
        main_next = logits[:, 1:].argmax(-1)  # the main model's token for i+2
        mtp_next = mtp_logits.argmax(-1)
        same += (main_next == mtp_next).sum().item()
        mtp_right += (mtp_next == y[:, 1:]).sum().item()
        main_right += (main_next == y[:, 1:]).sum().item()
        n += mtp_next.numel()
    return {
        "positions": n,
        "agreement": round(same / n, 6),
        "mtp_accuracy": round(mtp_right / n, 6),
        "main_accuracy": round(main_right / n, 6),
    }


@torch.no_grad()
def heldout_load(model: TinyMoE, wins: list[torch.Tensor]) -> dict:
    """Held-out tokens per expert, per MoE layer, with the learned routing biases and with
    them zeroed: what auxiliary-loss-free balancing does at inference."""
    routers = model.routers()
    saved = [r.e_score_correction_bias.clone() for r in routers]
    result = {}
    for label in ("with_bias", "without_bias"):
        if label == "without_bias":
            for r in routers:
                r.e_score_correction_bias.zero_()
        meter = LoadMeter(routers, SPEC.n_routed_experts)
        for win in wins:
            model(win[None, :-1])
        counts = meter.take()
        meter.remove()
        result[label] = {"counts": counts.tolist(), "max_violation": max_violation(counts)}
    for r, b in zip(routers, saved):
        r.e_score_correction_bias.copy_(b)
    layers = [i for i in range(SPEC.num_hidden_layers) if i >= SPEC.first_k_dense_replace]
    result["layers"] = layers + [SPEC.num_hidden_layers]  # the last is the MTP block
    return result


# ---------------------------------------------------------------- saving


def save(model: TinyMoE, tok: Tokenizer, path: Path) -> None:
    """train_tiny's folder, then the MTP module's tensors added to model.safetensors under
    model.layers.{num_hidden_layers}, where transformers' DeepseekV3ForCausalLM ignores them."""
    base.save(model.lm, tok, path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    mtp = model.mtp.checkpoint_tensors(SPEC.num_hidden_layers)
    tensors.update({k: v.half().contiguous() for k, v in mtp.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    file.chmod(0o644)


def load_tokenizer() -> tuple[Tokenizer, str]:
    """deepinfer-tiny's tokenizer as shipped, checked against its recorded sha256."""
    file = HERE / base.TARGET.name / "tokenizer.json"
    sha = hashlib.sha256(file.read_bytes()).hexdigest()
    recorded = json.loads((HERE / "records.json").read_text())["tokenizer"]["sha256"]
    if sha != recorded:
        raise SystemExit(f"{file} has sha256 {sha}, but records.json says {recorded}")
    return Tokenizer.from_file(str(file)), sha


# ---------------------------------------------------------------- records


def markdown(m: dict, evaluation: dict) -> str:
    a, t, ev, bal = m["architecture"], m["training"], m["evaluation"], m["evaluation"]["load"]
    mtp = ev["mtp"]
    lines = [
        MARKER,
        "",
        f"## {NAME}",
        "",
        "Generated by `snippets/models/train_tiny_moe.py` (its figures are in `records.json` "
        f"under `models.{NAME}`); same corpus, split and tokenizer as above.",
        "",
        f"DeepseekV3ForCausalLM: {a['num_hidden_layers']} layers ({a['first_k_dense_replace']} "
        f"dense, then MoE), hidden {a['hidden_size']}, "
        f"{a['num_attention_heads']} heads; MLA with q_lora_rank {a['q_lora_rank']}, "
        f"kv_lora_rank {a['kv_lora_rank']}, rope dim {a['qk_rope_head_dim']} (interleaved); "
        f"{a['n_routed_experts']} routed experts of width {a['moe_intermediate_size']} in "
        f"{a['n_group']} groups, top-{a['num_experts_per_tok']} of {a['topk_group']} groups, "
        f"{a['n_shared_experts']} shared expert; {a['num_nextn_predict_layers']} MTP module.",
        "",
        "| | parameters |",
        "|---|---:|",
        f"| main model (what transformers loads) | {m['parameters']:,} |",
        f"| MTP module (embedding and head shared) | {m['mtp_parameters']:,} |",
        f"| active per token, main model | {m['active_parameters']:,} |",
        "",
        f"On disk: {m['bytes_on_disk'] / 1e6:.2f} MB, float16. Everything under "
        f"`snippets/models` after this run: {m['run']['shipped_bytes'] / 1e6:.2f} MB.",
        "",
        "### Held-out evaluation",
        "",
        "| | perplexity |",
        "|---|---:|",
        f"| unigram baseline (train split, add-one) | {evaluation['unigram_perplexity']:.2f} |",
        f"| {NAME} | {ev['perplexity']:.2f} |",
        "",
        f"Unigram / {NAME} perplexity: {ev['perplexity_ratio']:.2f} (required: >= "
        f"{ev['min_perplexity_ratio']}).",
        "",
        f"MTP, teacher-forced over {mtp['positions']:,} held-out positions: its greedy token "
        f"for position i+2 equals the main model's greedy token for i+2 on "
        f"{mtp['agreement']:.2%} of them. The MTP token is the true one on "
        f"{mtp['mtp_accuracy']:.2%}, the main model's (one step later) on "
        f"{mtp['main_accuracy']:.2%}.",
        "",
        "### Expert load (auxiliary-loss-free balancing)",
        "",
        "Max violation = busiest expert's tokens / mean tokens per expert - 1 (0 is perfectly "
        "even). Held out, with the learned routing biases, and with them zeroed:",
        "",
        "| layer | with bias | without bias |",
        "|---|---:|---:|",
    ]
    for i, layer in enumerate(bal["layers"]):
        label = f"{layer} (MTP)" if layer == a["num_hidden_layers"] else str(layer)
        lines.append(
            f"| {label} | {bal['with_bias']['max_violation'][i]:.3f} "
            f"| {bal['without_bias']['max_violation'][i]:.3f} |"
        )
    lines += [
        "",
        "During training (max violation over each logging interval, per MoE layer):",
        "",
        "| step | train loss | MTP loss | max violation | lr | elapsed (min) |",
        "|---:|---:|---:|---|---:|---:|",
    ]
    lines += [
        f"| {h['step']} | {h['train_loss']:.4f} | {h['mtp_loss']:.4f} "
        f"| {', '.join(f'{v:.2f}' for v in h['max_violation'])} | {h['lr']:.2e} "
        f"| {h['elapsed_min']:.1f} |"
        for h in t["log"]
    ]
    r = m["run"]
    lines += [
        "",
        "Hyperparameters: "
        + ", ".join(f"{k}={v}" for k, v in m["hyperparameters"].items() if k != "log_every"),
        "",
        f"{t['steps_done']} of {t['steps_planned']} steps in {t['minutes']:.1f} min"
        + (" (cut short by --max-minutes)" if t["stopped_early"] else "")
        + f"; wall time {r['wall_minutes']:.1f} min, CPU time {r['cpu_minutes']:.1f} min over "
        f"{r['threads']} threads; seed {r['seed']}.",
        f"{r['python']}, torch {r['torch']}, transformers {r['transformers']}, {r['machine']}; "
        f"command: `{r['command']}`.",
        "",
        "To reproduce, rerun that command: on the same machine type and library versions two "
        "runs write byte-identical weights (the script's docstring gives a check that takes "
        "minutes, two `--steps 8` runs compared by sha256).",
        "",
        "Sample generations (greedy):",
        "",
    ]
    for prompt, text in ev["samples"].items():
        lines += ["```text", prompt + text, "```", ""]
    return "\n".join(lines)


def write_records(out: Path, entry: dict) -> None:
    """Add this model to records.json and RECORDS.md, keeping what train_tiny.py wrote."""
    rec_file, md_file = out / "records.json", out / "RECORDS.md"
    records = json.loads(rec_file.read_text())
    records["models"][NAME] = entry
    rec_file.write_text(json.dumps(records, indent=2) + "\n")
    text = md_file.read_text()
    head = text.split(MARKER)[0].rstrip("\n")
    md_file.write_text(head + "\n\n" + markdown(entry, records["evaluation"]))


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--steps", type=int, default=TRAINING.steps)
    parser.add_argument("--max-minutes", type=float, default=None, help="cut training short")
    args = parser.parse_args(argv)
    t0, cpu0 = time.perf_counter(), time.process_time()
    torch.set_num_threads(base.THREADS)

    import transformers

    transformers.logging.set_verbosity_error()
    records = json.loads((HERE / "records.json").read_text())
    commit = records["corpus"]["commit"]
    corpus = base.read_corpus(commit)
    sha = hashlib.sha256("".join(corpus.values()).encode()).hexdigest()
    if sha != records["corpus"]["sha256"]:
        raise SystemExit(f"the corpus at {commit} has sha256 {sha}, not the recorded one")
    train_paths, held_paths = base.split_files(list(corpus), base.HELDOUT_FRACTION)
    tok, tok_sha = load_tokenizer()
    vocab, eot = tok.get_vocab_size(), tok.token_to_id(base.EOT)
    train_stream = base.encode_stream(tok, [corpus[p] for p in train_paths])
    held_stream = base.encode_stream(tok, [corpus[p] for p in held_paths])
    spec = replace(TRAINING, steps=args.steps)
    held_wins = base.windows(held_stream, spec.seq_len)
    base.log(f"corpus {commit[:12]}: {len(train_stream)} train tokens, {len(held_stream)} held out")

    torch.manual_seed(args.seed)
    model = TinyMoE(SPEC, vocab, eot)
    base.log(f"{NAME}: {count_parameters(model.lm):,} + MTP {count_parameters(model.mtp):,}")
    deadline = None if args.max_minutes is None else t0 + 60 * args.max_minutes
    run = train(model, train_stream, spec, args.seed, deadline)
    base.as_shipped(model.lm)
    base.as_shipped(model.mtp)

    t_eval = time.perf_counter()
    ppl = base.perplexity(model.lm, held_wins)
    unigram = records["evaluation"]["unigram_perplexity"]
    mtp = mtp_agreement(model, held_wins)
    load = heldout_load(model, held_wins)
    generations = base.samples(model.lm, tok)
    eval_seconds = time.perf_counter() - t_eval
    base.log(f"held out: perplexity {ppl:.2f} (unigram {unigram:.2f}), MTP {mtp}")

    args.out.mkdir(parents=True, exist_ok=True)
    save(model, tok, args.out / NAME)
    experts_per_token = SPEC.num_experts_per_tok + SPEC.n_shared_experts
    idle = (SPEC.n_routed_experts - SPEC.num_experts_per_tok) * 3 * SPEC.hidden_size
    moe_layers = SPEC.num_hidden_layers - SPEC.first_k_dense_replace
    entry = {
        "parameters": count_parameters(model.lm),
        "mtp_parameters": count_parameters(model.mtp),
        "active_parameters": count_parameters(model.lm)
        - moe_layers * idle * SPEC.moe_intermediate_size,
        "experts_per_token": experts_per_token,
        "architecture": {"class": "DeepseekV3ForCausalLM", "name": NAME, **asdict(SPEC)},
        "dtype": "float16",
        "tied_embeddings": True,
        "tokenizer_sha256": tok_sha,
        "bytes_on_disk": base.folder_bytes(args.out / NAME),
        "hyperparameters": asdict(spec),
        "training": run,
        "evaluation": {
            "split": "heldout",
            "perplexity": round(ppl, 4),
            "perplexity_ratio": round(unigram / ppl, 4),
            "min_perplexity_ratio": 5.0,
            "perplexity_met": unigram / ppl >= 5,
            "mtp": mtp,
            "load": load,
            "samples": generations,
            "eval_seconds": round(eval_seconds, 1),
        },
        "run": {
            "seed": args.seed,
            "threads": base.THREADS,
            "wall_minutes": 0.0,
            "cpu_minutes": 0.0,
            "shipped_bytes": 0,
            "python": "Python " + platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": f"{platform.machine()} {platform.system()}",
            "command": " ".join(
                ["python snippets/models/train_tiny_moe.py", *(argv or sys.argv[1:])]
            ),
        },
    }
    if args.out != HERE:  # a dry run elsewhere: start from a copy of the shipped records
        for f in ("records.json", "RECORDS.md"):
            (args.out / f).write_text((HERE / f).read_text())
    for _ in range(2):  # the second time the records know their own size and the wall time
        entry["run"]["wall_minutes"] = round((time.perf_counter() - t0) / 60, 2)
        entry["run"]["cpu_minutes"] = round((time.process_time() - cpu0) / 60, 2)
        write_records(args.out, entry)
        entry["run"]["shipped_bytes"] = base.folder_bytes(args.out)
    base.log(f"done in {entry['run']['wall_minutes']:.1f} min; wrote {args.out / NAME}")
    return 0 if entry["evaluation"]["perplexity_met"] and math.isfinite(ppl) else 1


if __name__ == "__main__":
    sys.exit(main())
