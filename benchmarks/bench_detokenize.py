"""Detokenizing one long request: per-token cost at token ~100 and ~4,000, old approach vs incremental.

python3 benchmarks/bench_detokenize.py [--reps 3] [--num-tokens 4100] [--window 100]

One request's output is a long text encoded by a byte-level BPE trained here (GPT-2 style, a 2,000
token vocab, on seeded sentences with accents, CJK and emoji, so characters split across tokens).
Each token is timed on its own:
  old:  append the id, decode every id so far, drop a trailing incomplete character, search the
        stop strings in the whole text (what LLMEngine._output did per step)
  new:  IncrementalDetokenizer.add(id) + new_text()
with two stop strings that never match, so every token searches. The mean over --window tokens
centred on token 100 and on token 4,000 gives t(100) and t(4000); the median over --reps runs is
printed with the ratio t(4000)/t(100) (aim for the new one <= 1.2x). CPU only, no device.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time

from kvfit.text.detokenizer import IncrementalDetokenizer
from kvfit.text.tokenizer import Tokenizer

STOPS = ("\n\nUser:", "<|endoftext|>")
POSITIONS = (100, 4000)
SYLLABLES = ("ka ne ro mi tsu la be do fi gu ha je ko lu ma no pe qui ra si te vu wa xe yo za "
             "é è ç ñ ü ø å 東 京 日 本 語 中 文 한 국 🙂 🚀 👍🏽").split()
WORDS = ("the model reads every token and writes the next one while the cache keeps keys and values "
         "café naïve crème déjà vu Ångström Don't it's we're scheduler runner block prefix memory").split()


def corpus(num_sentences: int, seed: int) -> list[str]:
    """Seeded sentences: common words mixed with made-up ones (so the BPE learns many merges)."""
    rng = random.Random(seed)

    def word() -> str:
        if rng.random() < 0.5:
            return rng.choice(WORDS)
        if rng.random() < 0.1:      # rare CJK: its bytes stay split over tokens, so some are held back
            return "".join(chr(rng.randrange(0x4E00, 0x5E00)) for _ in range(rng.randint(1, 3)))
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))

    return [" ".join(word() for _ in range(rng.randint(4, 16))) + rng.choice(".!?,;")
            for _ in range(num_sentences)]


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE (any text encodes; characters may split across tokens) in our Tokenizer."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus(2000, seed=0), trainer=trainer)
    return Tokenizer(backend, {"eos_token": "</s>", "unk_token": "<unk>"})


def old_step(tok: Tokenizer, ids: list[int], token_id: int) -> None:
    """The O(n) per-token path: decode the whole output and search stops in the whole text."""
    ids.append(token_id)
    text = tok.decode(ids)
    text = text[:-1] if text.endswith("\ufffd") else text
    for stop in STOPS:
        assert text.find(stop) == -1


def run_old(tok: Tokenizer, output_ids: list[int]) -> list[float]:
    ids: list[int] = []
    seconds = []
    for token_id in output_ids:
        start = time.perf_counter()
        old_step(tok, ids, token_id)
        seconds.append(time.perf_counter() - start)
    return seconds


def run_new(tok: Tokenizer, output_ids: list[int]) -> list[float]:
    detok = IncrementalDetokenizer(tok, STOPS)
    seconds = []
    for token_id in output_ids:
        start = time.perf_counter()
        assert detok.add(token_id) is None
        detok.new_text()
        seconds.append(time.perf_counter() - start)
    assert detok.final_text() == tok.decode(output_ids)      # the same text as the old path's last step
    return seconds


def window_mean_us(seconds: list[float], centre: int, window: int) -> float:
    chunk = seconds[centre - window // 2:centre + window // 2]
    return statistics.fmean(chunk) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-tokens", type=int, default=4100)
    ap.add_argument("--window", type=int, default=100)
    args = ap.parse_args()
    assert args.num_tokens >= POSITIONS[-1] + args.window // 2, "--num-tokens must reach past the last window"
    tok = train_tokenizer()
    output_ids: list[int] = []
    seed = 1
    while len(output_ids) < args.num_tokens:   # one long text, never holding a stop string
        output_ids = tok.encode(" ".join(corpus(400 * seed, seed=seed)), add_special_tokens=False)
        seed += 1
    output_ids = output_ids[:args.num_tokens]
    print(f"bench_detokenize: python {platform.python_version()} on {platform.processor() or platform.machine()}, "
          f"{len(output_ids)} tokens, vocab {tok.vocab_size}, stops {STOPS!r}, {args.reps} repetitions, "
          f"mean of {args.window} tokens around each position, median over repetitions")
    runs = {"old": run_old, "new": run_new}
    results: dict[str, list[list[float]]] = {name: [] for name in runs}
    gc.disable()            # a collection landing in one window says nothing about the detokenizer
    for _ in range(args.reps):
        for name, run in runs.items():       # alternate, so machine drift lands on both alike
            seconds = run(tok, output_ids)
            results[name].append([window_mean_us(seconds, pos, args.window) for pos in POSITIONS])
            gc.collect()
    gc.enable()
    header = f"{'approach':<9}" + "".join(f"{f't({pos}) us':>14}" for pos in POSITIONS) + \
        f"{f't({POSITIONS[-1]})/t({POSITIONS[0]})':>16}"
    print()
    print(header)
    print("-" * len(header))
    ratios = {}
    for name, reps in results.items():
        medians = [statistics.median(rep[i] for rep in reps) for i in range(len(POSITIONS))]
        ratios[name] = medians[-1] / medians[0]
        print(f"{name:<9}" + "".join(f"{t:>14.2f}" for t in medians) + f"{ratios[name]:>15.2f}x")
    print()
    print(f"new ratio {ratios['new']:.2f}x (aim <= 1.2x); old ratio {ratios['old']:.2f}x")
    return 0 if ratios["new"] <= 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())
