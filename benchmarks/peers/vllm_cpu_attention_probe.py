"""Random steps, far past the conformance grid, for vLLM's CPU attention kernel
(the `vllm_cpu` backend) against kvforge's float64 reference.

Each case is one ragged step of 1 to 5 sequences: contexts up to 3,000 tokens,
chunks of up to 300 new tokens, block sizes 16 to 128, head sizes 64 to 256,
1 to 16 query heads per KV head, float32 / float16 / bfloat16, with a sliding
window (short or long), a logit soft-cap and ALiBi drawn at random. It is judged
exactly as the conformance suite judges (`attention_cases.check_case`: NaN in
unreferenced blocks, NaN-poisoned output, guarantee 3's tolerances). Runs where
vLLM's CPU build and kvforge are installed together:

    python -m kvforge.benchmarks.peers.vllm_cpu_attention_probe --threads 2 --cases 60 --seed 2
"""

from __future__ import annotations

import argparse
import random

import torch

from kvforge.conformance.attention_cases import Target, check_case, make_case, make_layer
from kvforge.core import ATTENTION_BACKEND, build_registry


def random_case(rng: random.Random, seed: int):
    block, head = rng.choice([16, 32, 64, 128]), rng.choice([64, 96, 128, 256])
    ratio = rng.choice([1, 2, 4, 8, 16])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    lengths = []
    for _ in range(rng.choice([1, 1, 2, 5])):
        context = rng.choice([0, rng.randint(1, 64), rng.randint(500, 3000)])
        new = rng.choice([1, 1, rng.randint(2, 40), rng.randint(100, 300)])
        lengths.append((context, new))
    layer = make_layer(head, ratio, sliding_window=rng.choice([None, None, rng.randint(1, 40), rng.randint(100, 1500)]),
                       soft_cap=rng.choice([None, None, 5.0, 30.0]), alibi=rng.random() < 0.3)
    return make_case("mixed", layer, block, dtype, seed, lengths=lengths)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (vLLM's kernel uses them too)")
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    registration = build_registry().get(ATTENTION_BACKEND, "vllm_cpu")
    availability = registration.availability()
    if not availability.ok:
        parser.error(f"vllm_cpu is unavailable here: {availability.reason}")
    torch.set_num_threads(args.threads)
    target, rng = Target(registration.cls, "cpu", reduced=False), random.Random(args.seed)
    problems = [p for i in range(args.cases) if (p := check_case(target, random_case(rng, args.seed * 10_000 + i)))]
    print(f"vllm_cpu at {args.threads} thread(s), seed {args.seed}: {args.cases} cases, {len(problems)} failing")
    print("\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
