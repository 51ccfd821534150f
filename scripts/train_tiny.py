"""Train the built-in tiny models `kvforge-tiny` and `kvforge-tiny-draft`.

Both are byte-level Llama-style models (256 byte tokens plus 3 special tokens),
trained on the Python standard library's own `.py` sources, which every machine
with Python has. The run is reproducible: a fixed seed, a fixed file split and a
fixed number of steps (no wall-clock stopping).

    python scripts/train_tiny.py --out models/builtin --threads 1

Data: every `.py` file under `sysconfig.get_paths()["stdlib"]`, minus
`site-packages` and test folders, sorted by relative path. A file is held out
when the first byte of sha256(relative path) is below 13 (about 5%). Training
draws random windows from the concatenated training files (each file is
`<bos> bytes <eos>`); evaluation reads the held-out stream in consecutive
windows.

Outputs, per model, under `<out>/<name>/`: `config.json` and `model.safetensors`
(a Hugging Face Llama checkpoint, weights stored in bfloat16),
`kvforge_tokenizer.json` (marks the byte-level tokenizer), `eval.json` with
the held-out bits per byte (of the bfloat16 weights, computed in float32), and
`heldout_slice.txt`, a small piece of the held-out text whose exact loss is
recorded in `eval.json` so a test can reproduce it on any machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB_SIZE = 259
BOS, EOS, PAD = 256, 257, 258

# name -> (LlamaConfig fields, training settings)
MODELS = {
    "kvforge-tiny-draft": (
        dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2),
        dict(steps=1000, batch=16, seq_len=256, lr=5e-3),
    ),
    "kvforge-tiny": (
        dict(hidden_size=256, intermediate_size=640, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4),
        dict(steps=4000, batch=8, seq_len=256, lr=3e-3),
    ),
}
EVAL_BYTES = 131072  # held-out bytes scored for the documented bits per byte
SLICE_BYTES = 2048  # held-out bytes shipped with the model for the reproduction test


def source_files() -> list[tuple[str, bytes]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test"}
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if skip & set(rel.split("/")[:-1]):
            continue
        files.append((rel, path.read_bytes()))
    return files


def is_heldout(rel: str) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] < 13


def stream(files: list[tuple[str, bytes]]) -> torch.Tensor:
    ids = []
    for _, data in files:
        ids.append(BOS)
        ids.extend(data)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long)


def llama_config(fields: dict, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=1024, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS,
                       pad_token_id=PAD, attention_bias=False, mlp_bias=False, **fields)


@torch.no_grad()
def bits_per_byte(model, ids: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss in bits over consecutive windows of `ids`."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, seq_len):
        window = ids[start:start + seq_len + 1]
        if window.numel() < 2:
            break
        logits = model(window[None, :-1]).logits[0].float()
        total += F.cross_entropy(logits, window[1:], reduction="sum").item()
        count += window.numel() - 1
    model.train()
    return total / count / math.log(2)


def train(name: str, out: Path, train_ids: torch.Tensor, heldout: torch.Tensor, seed: int, log) -> None:
    from transformers import LlamaForCausalLM

    fields, opts = MODELS[name]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(fields, opts["seq_len"]))
    params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {params:,} parameters, {opts}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    steps, warmup = opts["steps"], 50
    schedule = lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    generator = torch.Generator().manual_seed(seed)
    span = opts["seq_len"] + 1
    began = time.time()
    for step in range(steps):
        starts = torch.randint(0, train_ids.numel() - span, (opts["batch"],), generator=generator)
        batch = torch.stack([train_ids[s:s + span] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = opts["lr"] * schedule(step)
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"{name} step {step} loss {loss.item() / math.log(2):.3f} bits/byte ({time.time() - began:.0f}s)")

    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
    (target / "generation_config.json").unlink(missing_ok=True)
    (target / "kvforge_tokenizer.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}) + "\n")
    (target / "eval.json").write_text(json.dumps({
        "parameters": params, "steps": steps, "seed": seed, "train_tokens": steps * opts["batch"] * opts["seq_len"],
        "train_seconds": round(time.time() - began), "python": sys.version.split()[0],
    }, indent=2) + "\n")
    score(target, heldout, log)


def score(target: Path, heldout: torch.Tensor, log) -> None:
    """Score exactly what ships: the saved bfloat16 weights, reloaded and computed in float32.

    Writes the held-out bits per byte, and the slice with its own figure, into the model directory."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    eval_bpb = bits_per_byte(model, heldout[:EVAL_BYTES], 512)
    piece = heldout_slice(heldout)
    slice_bpb = bits_per_byte(model, torch.tensor([BOS, *piece]), 512)
    log(f"{target.name}: held-out {eval_bpb:.4f} bits/byte over {EVAL_BYTES} bytes; slice {slice_bpb:.4f}")
    (target / "heldout_slice.txt").write_bytes(bytes(piece))
    record = json.loads((target / "eval.json").read_text())
    record.update({"heldout_bits_per_byte": round(eval_bpb, 4), "heldout_bytes": EVAL_BYTES,
                   "slice_bits_per_byte": slice_bpb, "slice_window": 512})
    (target / "eval.json").write_text(json.dumps(record, indent=2) + "\n")


def heldout_slice(heldout: torch.Tensor) -> list[int]:
    """The first SLICE_BYTES bytes of held-out file contents (special tokens left out)."""
    return [i for i in heldout[:4 * SLICE_BYTES].tolist() if i < 256][:SLICE_BYTES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "models" / "builtin")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=sorted(MODELS), help="train one model only")
    parser.add_argument("--steps", type=int, help="override the step count (for a quick try)")
    parser.add_argument("--score-only", action="store_true", help="re-score the models already in --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(time.strftime("%H:%M:%S"), message, flush=True)

    files = source_files()
    train_files = [f for f in files if not is_heldout(f[0])]
    heldout_files = [f for f in files if is_heldout(f[0])]
    train_ids, heldout = stream(train_files), stream(heldout_files)
    log(f"{len(train_files)} training files ({train_ids.numel():,} bytes), "
        f"{len(heldout_files)} held-out files ({heldout.numel():,} bytes)")
    for name in MODELS:
        if args.only and name != args.only:
            continue
        if args.score_only:
            score(args.out / name, heldout, log)
            continue
        if args.steps:
            MODELS[name][1]["steps"] = args.steps
        train(name, args.out, train_ids, heldout, args.seed, log)


if __name__ == "__main__":
    main()
