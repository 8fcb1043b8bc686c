"""Train a small DeepSeek-V3-shaped MoE on this machine's own technical prose, for accuracy work.

Random weights make quantization error meaningless (every algorithm looks alike on them); this writes a
model that was actually trained, in transformers' `deepseek_v3` layout, to OUT:

    nice -n 10 python bench/train_tiny_moe.py OUT            # about 25 minutes on one CPU thread

Its shape is DeepSeek-V3's in small: MLA with low-rank queries and a compressed key/value latent, a first
dense layer, a sigmoid router with a correction bias choosing top-k groups then top-k experts, a shared
expert beside 16 routed ones. The text is the docstrings of Python's standard library and of the installed
packages, and the documentation files under /usr/share/doc and the packages (technical English prose),
split into documents, each document kept whole in one of three sets by a hash of its source: training,
calibration (`calib.jsonl`, 256 documents as the shared fixture's) and evaluation (`eval.txt`, documents
joined by `<|endoftext|>`). The tokenizer is eprt's tiny byte-level BPE (vocab 512, `<|endoftext|>` = 0
between documents).

Load balancing is DeepSeek-V3's, per layer: after every step each router's correction bias moves by
`--bias-rate` towards the experts that took fewer tokens than the mean, and a small sequence-wise balance
loss keeps the scores themselves spread, so every expert of every layer is used (the run prints each
layer's least and most used expert's share on the evaluation text).

The run is deterministic for a given corpus (seeded sampling, one thread); what the machine holds decides
the corpus, so the README it writes records the token counts and the held-out perplexity.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import math
import os
import sys
import time

import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from eprt.storage.atomic import atomic_output_dir, copy_files
from eprt.testing.tiny import TINY_DIR

EOT = 0  # <|endoftext|>
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
MIN_DOC_CHARS = 400
CALIB_DOCS = 256


def model_config() -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,  # the first, dense layer
        moe_intermediate_size=64,
        num_hidden_layers=5,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        rope_interleave=True,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOT,
        pad_token_id=EOT,
        initializer_range=0.02,
    )


# -- the corpus ---------------------------------------------------------------------------------------------


def python_docstrings(path: str) -> str:
    """A module's docstrings as one document: the module's, then each class's and function's under its name."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return ""
    parts = [ast.get_docstring(tree) or ""]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                parts.append(f"{node.name}\n{doc}")
    return "\n\n".join(p for p in parts if p).strip()


def doc_file(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read().strip()
    except (UnicodeDecodeError, OSError, EOFError):
        return ""


def is_doc_file(name: str) -> bool:
    base = name.removesuffix(".gz").lower()
    if base.startswith(("copyright", "license", "changelog", "news", "changes", "authors")):
        return False
    return base.endswith((".md", ".rst", ".txt")) or base.startswith("readme")


def sources(roots: list[str]) -> list[str]:
    found = []
    for root in roots:
        for d, subdirs, files in os.walk(root):
            subdirs[:] = sorted(s for s in subdirs if s not in ("test", "tests", "__pycache__", "testing"))
            found += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py") or is_doc_file(f)]
    return found


def documents(roots: list[str], max_doc_chars: int) -> list[tuple[str, str]]:
    """(source path, text) of every document, cut into pieces of at most `max_doc_chars` at paragraph
    breaks; duplicates (the same text installed twice) are kept once."""
    seen, docs = set(), []
    for path in sources(roots):
        text = python_docstrings(path) if path.endswith(".py") else doc_file(path)
        if len(text) < MIN_DOC_CHARS:
            continue
        piece, n = [], 0
        for para in text.split("\n\n"):
            piece.append(para)
            n += len(para) + 2
            if n >= max_doc_chars:
                docs.append((path, "\n\n".join(piece)))
                piece, n = [], 0
        if n >= MIN_DOC_CHARS:
            docs.append((path, "\n\n".join(piece)))
    unique = []
    for path, text in docs:
        key = hashlib.sha1(text.encode()).digest()
        if key not in seen:
            seen.add(key)
            unique.append((path, text))
    return unique


def split_of(path: str, eval_share: float) -> str:
    """Every piece of one source file lands in the same set, so no held-out text was seen in training."""
    u = int.from_bytes(hashlib.sha1(path.encode()).digest()[:8], "big") / 2**64
    return "eval" if u < eval_share else "heldout_calib" if u < 2 * eval_share else "train"


# -- training -----------------------------------------------------------------------------------------------


class Balance:
    """DeepSeek-V3's per-layer balancing: the correction bias follows each step's loads, and a
    sequence-wise loss (weight `alpha`) on the normalised scores."""

    def __init__(self, model: DeepseekV3ForCausalLM, rate: float, alpha: float):
        self.gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.rate, self.alpha = rate, alpha
        self.loads = [torch.zeros(g.num_experts) for g in self.gates]
        self.losses: list[torch.Tensor] = []
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(self.hook(i))

    def hook(self, i: int):
        def observe(gate, inputs, outputs):
            logits_TE, _, topk_TK = outputs
            E, K = gate.num_experts, gate.top_k
            load_E = torch.bincount(topk_TK.flatten(), minlength=E).float()
            self.loads[i] += load_E
            if gate.training:
                scores_TE = logits_TE.sigmoid()
                p_E = (scores_TE / scores_TE.sum(-1, keepdim=True)).mean(0)
                self.losses.append(self.alpha * E / K * (load_E / load_E.sum() * K * p_E).sum())

        return observe

    def take_loss(self) -> torch.Tensor:
        loss, self.losses = sum(self.losses), []
        return loss

    @torch.no_grad()
    def update_biases(self) -> None:
        for gate, load_E in zip(self.gates, self.loads):
            gate.e_score_correction_bias += self.rate * torch.sign(load_E.mean() - load_E)
            load_E.zero_()

    def shares(self) -> list[tuple[float, float]]:
        return [((l.min() / l.sum()).item(), (l.max() / l.sum()).item()) for l in self.loads]


def windows(ids: torch.Tensor, seq: int, batch: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([ids[s : s + seq + 1] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq: int, batch: int = 16) -> float:
    model.eval()
    n = (ids.numel() - 1) // seq
    total, count = 0.0, 0
    for b in range(0, n, batch):
        rows = torch.stack([ids[i * seq : i * seq + seq + 1] for i in range(b, min(n, b + batch))])
        logits = model(rows[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        count += rows[:, 1:].numel()
    model.train()
    return math.exp(total / count)


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup, then a cosine to a tenth of the peak over `progress` (0 to 1)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, balance: Balance, ids: torch.Tensor, a: argparse.Namespace) -> int:
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(a.seed)
    start = time.time()
    step = 0
    for step in range(a.steps):
        # The schedule follows the steps or the time limit, whichever is nearer its end, so a run
        # cut by the limit still anneals (and is then not repeatable bit for bit).
        progress = max(step / a.steps, (time.time() - start) / (a.max_minutes * 60))
        if progress >= 1:
            print(f"stopped at the time limit after {step} steps", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, a.lr, a.warmup)
        rows = windows(ids, a.seq_len, a.batch, g)
        logits = model(rows[:, :-1]).logits
        lm_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss = lm_loss + balance.take_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance.update_biases()
        if step % 50 == 0:
            print(f"step {step} loss {lm_loss.item():.3f} {time.time() - start:.0f}s", flush=True)
    else:
        step = a.steps
    return step


def tokenize(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids + [EOT]
    return torch.tensor(ids, dtype=torch.long)


def first_tokens(tok: Tokenizer, texts: list[str], n: int) -> list[str]:
    """The leading documents of `texts` that hold about `n` tokens."""
    kept, count = [], 0
    for text in texts:
        if count >= n:
            break
        kept.append(text)
        count += len(tok.encode(text, add_special_tokens=False).ids) + 1
    return kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the directory to write (must not exist)")
    default_roots = [os.path.dirname(os.__file__), "/usr/share/doc"]
    p.add_argument("--roots", nargs="+", default=default_roots, help="where to gather the text")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--bias-rate", type=float, default=2e-3)
    p.add_argument("--balance-loss", type=float, default=1e-2)
    p.add_argument("--max-minutes", type=float, default=28.0, help="stop training early past this")
    p.add_argument("--eval-share", type=float, default=0.03, help="of the sources held out, and again for calibration")
    p.add_argument("--eval-tokens", type=int, default=250_000, help="the evaluation text's length, about")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)

    tok = Tokenizer.from_file(os.path.join(TINY_DIR, "tokenizer.json"))
    docs = documents(a.roots, max_doc_chars=6000)
    sets: dict[str, list[str]] = {"train": [], "eval": [], "heldout_calib": []}
    for path, text in docs:
        sets[split_of(path, a.eval_share)].append(text)
    calib = sets["heldout_calib"][:CALIB_DOCS]
    eval_docs = first_tokens(tok, sets["eval"], a.eval_tokens)
    train_ids, eval_ids = tokenize(tok, sets["train"]), tokenize(tok, eval_docs)
    print(f"{len(docs)} documents; train {train_ids.numel()} tokens, eval {eval_ids.numel()} tokens", flush=True)

    model = DeepseekV3ForCausalLM(model_config()).float().train()
    balance = Balance(model, a.bias_rate, a.balance_loss)
    n_params = sum(t.numel() for t in model.parameters())
    t0 = time.time()
    steps = train(model, balance, train_ids, a)
    minutes = (time.time() - t0) / 60

    model = model.to(torch.bfloat16)
    for gate in balance.gates:  # transformers keeps the router in fp32 as the releases do
        gate.float()
    ppl = perplexity(model, eval_ids, a.seq_len)
    shares = balance.shares()
    print(f"held-out perplexity {ppl:.2f}; per-layer expert shares (min, max) {shares}", flush=True)

    with atomic_output_dir(a.out) as tmp:
        model.save_pretrained(tmp)
        copy_files(TINY_DIR, TOKENIZER_FILES, tmp)
        with open(os.path.join(tmp, "calib.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in calib)
        with open(os.path.join(tmp, "eval.txt"), "w") as f:
            f.write("<|endoftext|>".join(eval_docs))
        readme = README.format(
            params=n_params / 1e6,
            tokens=steps * a.batch * a.seq_len / 1e6,
            corpus=train_ids.numel() / 1e6,
            eval_tokens=eval_ids.numel() / 1e3,
            steps=steps,
            minutes=minutes,
            ppl=ppl,
            least=min(s[0] for s in shares),
            most=max(s[1] for s in shares),
            command=" ".join(["python bench/train_tiny_moe.py", *sys.argv[1:]]),
        )
        with open(os.path.join(tmp, "README.md"), "w") as f:  # last: its presence says the model is whole
            f.write(readme)
    print(f"wrote {a.out}")


README = """# A trained DeepSeek-V3-shaped MoE for accuracy work

Random weights make quantization error meaningless: every algorithm looks alike on them. This is a small
DeepSeek-V3 that was actually trained, so quantization changes its predictions as it would a real model's.

- Shape: hidden 128, 5 layers (the first dense, intermediate 384; then MoE), MLA with 4 heads (q_lora_rank 64,
  kv_lora_rank 32, qk_nope 32 + qk_rope 16, v 32, interleaved rope), 16 routed experts in 4 groups (top-2
  groups, top-4 experts), sigmoid router with correction bias and routed_scaling_factor 2.5, one shared expert,
  `moe_intermediate_size` 64, untied embeddings, 512 positions (trained on 256-token windows), no MTP layer.
  {params:.2f} M parameters, bf16 (the router in fp32), `save_pretrained` layout.
- Trained for {steps} steps ({tokens:.1f} M tokens of 256-token windows, {minutes:.0f} min wall on one CPU thread)
  drawn from {corpus:.1f} M tokens of English technical prose (Python docstrings, package and system documentation files), with DeepSeek-V3's
  per-layer load balancing (correction-bias updates and a small sequence-wise loss): on the held-out text every
  expert of every layer takes between {least:.1%} and {most:.1%} of its layer's routed tokens (1/16 = 6.25%).
- Tokenizer: the byte-level BPE of eprt's tiny models (vocab 512); `<|endoftext|>` = id 0 separates documents.
- `calib.jsonl`: 256 lines of `{{"text": ...}}`, held-out documents (never trained on), as the Qwen3-MoE fixture's.
- `eval.txt`: held-out documents joined by `<|endoftext|>` (about {eval_tokens:.0f}k tokens), never seen in training
  or in `calib.jsonl`. Perplexity of the bf16 model over 256-token windows of the full held-out set: {ppl:.2f}.

Remade by `{command}` (the corpus is what the machine has installed, so another machine's model differs).
Use it in `bench/` (pass its path), not as a test dependency.
"""


if __name__ == "__main__":
    main()
