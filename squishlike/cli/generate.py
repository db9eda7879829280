"""Load a model with squishlike.load and generate a reply to a prompt."""

from __future__ import annotations

import argparse

HELP = "generate text, in the spirit of `mlx_lm generate`"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..tiers import TIER_NAMES

    parser.add_argument("--model", required=True, help="npy-dir, or any model the provider reads")
    parser.add_argument("--prompt", "-p", default="What is the capital of France?", help="the prompt")
    parser.add_argument("--max-tokens", "-m", type=int, default=100, help="maximum tokens to generate")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument("--tier", choices=TIER_NAMES, help="force a tier of an npy-dir")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="feed the prompt raw, without the chat template")


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    from ..loader import load

    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = load(args.model, tier=args.tier)
    prompt = args.prompt
    if tokenizer.chat_template is not None and not args.no_chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    text = generate(model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=make_sampler(args.temp))
    print(text)
    return 0
