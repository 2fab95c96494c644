"""Host time of one decode step at 256 running sequences with 1k-token contexts, before and after, in one run.

python benchmarks/bench_host_step.py [--ref 155f1c3] [--after REV] [--steps 25] [--reps 7]
                                     [--prefix-caching off|on|both] [--out benchmarks/results/DATE-cpu-host-step.json]

The model costs ~nothing: CausalLM.forward and compute_logits are patched at class level (before the
engine is built) to return slices of cached buffers (zero hidden states [T, hidden], fixed random
logits [N, vocab] whose rows rotate each call, so the argmax token changes from step to step). What
engine.step(stream=True) then costs is host work: schedule, build inputs, sample (argmax over a
32,000-token vocabulary), apply outputs, detokenize.

"Before" is the engine at --ref, checked out with `git worktree add --detach` into a temp folder
(removed at the end); "after" is this checkout's working tree, or --after REV checked out the same
way (--after 155f1c3 runs the same engine twice: the ratio is then the noise). Each side runs in its
own subprocess with PYTHONPATH=<side>/src (the child checks that kvfit.__file__ is under it), on the
same tiny Llama folder (trained 32,000-token BPE tokenizer), the same seeded prompts and the same
workload: --num-seqs requests of --prompt-len random token ids are prefilled and --warmup decode steps
run; then --reps windows of --steps decode steps are timed with time.perf_counter (gc collected
before each window, left on inside it, as a server runs). Both sides stay up and their windows
alternate (before, after, after, before, ...), so load from other processes lands on both alike.
Every timed step must return one output per sequence (no finishes, no preemptions).

Prints ms per step per side, wall (time.perf_counter) and CPU (time.process_time of that side's
process, single-threaded with --torch-threads 1, so load from other processes barely moves it): the
median over the windows, min, max, spread = (max - min) / median (the windows run one after another,
so a step cost that grows with the generated length shows in the spread too); and the ratios of the
medians before/after (> 1: after is faster). The greedy argmax over [256, 32000] logits is a large fixed part
of a CPU step (on a GPU it runs on the device); each side also times it alone on the same logits, and
the last ratio leaves it out. CPU only; the numbers are this host's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time

DEFAULT_REF = "155f1c3"     # the engine before the host-path rewrite
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the tiny model: a real vocabulary size (token ids and the argmax as in a 7B Llama), ~nothing else
VOCAB_SIZE = 32000
HIDDEN_SIZE = 16
NUM_LAYERS = 1
NUM_HEADS = 2
NUM_KV_HEADS = 1
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
KV_DTYPE_BYTES = 4              # float32
BLOCK_SIZE = 16                 # the engine's default, used only to size the KV budget with slack
LOGIT_ROTATION_ROWS = 61        # logits rows rotate by one per call over this many extra rows
UNK, BOS, EOS = "<unk>", "<s>", "</s>"   # ids 0, 1, 2
FIRST_PROMPT_ID = 3             # prompts avoid the special tokens


# the tiny model folder (recipe of tests/tiny_models.py, with a 32,000-token tokenizer) ------------
def train_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE with <unk> <s> </s> as ids 0 1 2 and bos added, trained on seeded random words
    (a natural corpus this small stops merging long before 32,000 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(60000)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(20000)]
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[UNK, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 1)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the tokenizer trained to {tok.get_vocab_size()} tokens, not {vocab_size}")
    return tok


def make_model(folder: str, max_position_embeddings: int, seed: int) -> str:
    """Write a tiny random Llama folder (config, safetensors, tokenizer) and return its path."""
    import torch
    import transformers
    os.makedirs(folder, exist_ok=True)
    tok = train_tokenizer(VOCAB_SIZE, seed)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "unk_token": UNK,
                   "bos_token": BOS, "model_max_length": max_position_embeddings,
                   "clean_up_tokenization_spaces": False, "add_bos_token": True, "add_eos_token": False}, fh)
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, fh)
    return folder


# the child: one side's measurement -----------------------------------------------------------
class FreeModel:
    """Replaces CausalLM.forward / compute_logits with slices of cached buffers (no model compute)."""

    def __init__(self, seed: int):
        import torch
        self.torch = torch
        self.generator = torch.Generator().manual_seed(seed)
        self.hidden = torch.zeros(0, HIDDEN_SIZE)                   # [T, hidden]
        self.logits = torch.zeros(0, VOCAB_SIZE)                    # [N + rotation, vocab] float32
        self.num_logit_calls = 0

    def forward(self, input_ids):
        num_tokens = input_ids.shape[0]
        if self.hidden.shape[0] < num_tokens:
            self.hidden = self.torch.zeros(num_tokens, HIDDEN_SIZE)
        return self.hidden[:num_tokens]                              # [T, hidden]

    def compute_logits(self, hidden):
        num_rows = hidden.shape[0]
        if self.logits.shape[0] < num_rows + LOGIT_ROTATION_ROWS:
            self.logits = self.torch.randn(num_rows + LOGIT_ROTATION_ROWS, VOCAB_SIZE, generator=self.generator)
        start = self.num_logit_calls % LOGIT_ROTATION_ROWS
        self.num_logit_calls += 1
        return self.logits[start:start + num_rows]                  # [N, vocab]

    def install(self) -> None:
        from kvfit.models.llama import CausalLM
        free = self
        # input_ids [T] is the first argument; the rest (positions, caches, metadata) is not needed
        CausalLM.forward = lambda model, *args, **kwargs: free.forward(args[0] if args else kwargs["input_ids"])
        CausalLM.compute_logits = lambda model, hidden: free.compute_logits(hidden)


def check_import(src: str) -> str:
    """kvfit's file, which must lie under src (PYTHONPATH comes before the editable install's path)."""
    import kvfit
    path = os.path.realpath(kvfit.__file__)
    if not path.startswith(os.path.realpath(src) + os.sep):
        raise RuntimeError(f"kvfit imported from {path}, not from {src}; PYTHONPATH did not take precedence")
    return path


def start_engine(args):
    """Start the engine on args.model, add the requests, prefill them all and run the warm-up decode
    steps; return (llm, facts about the start-up for the row)."""
    import kvfit
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(FIRST_PROMPT_ID, VOCAB_SIZE) for _ in range(args.prompt_len)]
               for _ in range(args.num_seqs)]
    # requests prefilled early decode while the rest prefill: let them run to max_model_len, and give
    # the cache room for all of them there, so no request finishes or is preempted while timed
    max_tokens = args.max_model_len - args.prompt_len
    num_kv_tokens = args.num_seqs * (args.max_model_len + BLOCK_SIZE)
    kv_bytes = int(1.25 * num_kv_tokens * 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * KV_DTYPE_BYTES)
    start = time.perf_counter()
    llm = kvfit.LLM(args.model, device="cpu", dtype="float32", max_model_len=args.max_model_len,
                    max_num_seqs=args.num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_memory=kv_bytes, enable_prefix_caching=args.prefix_caching == "on",
                    num_scheduler_steps=1, seed=args.seed)
    engine = llm.engine
    params = kvfit.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    startup_s = time.perf_counter() - start
    start = time.perf_counter()
    started: set[str] = set()
    num_prefill_steps = 0
    while len(started) < args.num_seqs:
        started.update(out.request_id for out in engine.step(stream=True))
        num_prefill_steps += 1
        if num_prefill_steps > args.num_seqs * args.prompt_len:
            raise RuntimeError(f"only {len(started)} of {args.num_seqs} requests started decoding")
    prefill_s = time.perf_counter() - start
    for _ in range(args.warmup):
        num_outputs = len(engine.step(stream=True))
        if num_outputs != args.num_seqs:
            raise RuntimeError(f"a warm-up decode step returned {num_outputs} outputs, not {args.num_seqs}")
    return llm, {"kv_cache_memory": kv_bytes, "startup_s": startup_s, "prefill_s": prefill_s,
                 "num_prefill_steps": num_prefill_steps}


def time_window(engine, num_seqs: int, steps: int) -> dict:
    """Wall and CPU ms per step over `steps` decode steps; each must return one output per sequence."""
    gc.collect()
    num_outputs = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        num_outputs += len(engine.step(stream=True))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if num_outputs != steps * num_seqs:
        raise RuntimeError(f"{steps} decode steps returned {num_outputs} outputs, not {steps * num_seqs}: "
                           "requests finished or were preempted")
    return {"wall_ms": wall / steps * 1e3, "cpu_ms": cpu / steps * 1e3}


def time_argmax(free: FreeModel, num_rows: int, steps: int) -> dict:
    """Wall and CPU ms of torch.argmax over [num_rows, vocab] logits alone: on CPU the greedy sample is
    a large, fixed part of the step that no host-side change touches (on a GPU it runs on the device)."""
    import torch
    hidden = torch.zeros(num_rows, HIDDEN_SIZE)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        torch.argmax(free.compute_logits(hidden), dim=-1)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_ms": wall / steps * 1e3, "cpu_ms": cpu / steps * 1e3}


def emit(tag: str, value) -> None:
    print(f"{tag} {json.dumps(value)}", flush=True)


def serve_child(args) -> None:
    """One side: start and warm up, say READY, then run what the parent asks for on stdin, one line
    each (`window`: a timed window of decode steps; `argmax`: a window of the argmax alone; `done`)."""
    kvfit_file = check_import(args.src)
    import torch
    torch.set_num_threads(args.torch_threads)
    free = FreeModel(args.seed)
    free.install()
    llm, row = start_engine(args)
    emit("READY", row)
    windows, argmax = [], []
    for line in sys.stdin:
        command = line.strip()
        if command == "window":
            windows.append(time_window(llm.engine, args.num_seqs, args.steps))
            emit("WINDOW", windows[-1])
        elif command == "argmax":
            argmax.append(time_argmax(free, args.num_seqs, args.steps))
            emit("ARGMAX", argmax[-1])
        elif command == "done":
            break
        else:
            raise RuntimeError(f"unknown command {command!r}")
    outs = llm.engine.step(stream=True)
    assert len(outs) == args.num_seqs and not any(out.finished for out in outs) and llm.engine.has_unfinished()
    llm.shutdown()
    row.update(side=args.side, rev=args.rev, kvfit_file=kvfit_file, prefix_caching=args.prefix_caching,
               torch_threads=torch.get_num_threads(),
               ms_per_step=[w["wall_ms"] for w in windows], cpu_ms_per_step=[w["cpu_ms"] for w in windows],
               argmax_ms=[a["wall_ms"] for a in argmax], argmax_cpu_ms=[a["cpu_ms"] for a in argmax])
    emit("RESULT", row)


# the parent: worktrees, model, both sides interleaved, table ------------------------------------
def git(*argv: str) -> str:
    return subprocess.run(["git", "-C", REPO, *argv], check=True, capture_output=True, text=True).stdout.strip()


class Child:
    """One side's subprocess, PYTHONPATH=<src>, driven line by line."""

    def __init__(self, args, side: str, rev: str, src: str, model: str, prefix_caching: str):
        self.side, self.rev = side, rev
        argv = [sys.executable, os.path.abspath(__file__), "--child", "--side", side, "--rev", rev, "--src", src,
                "--model", model, "--prefix-caching", prefix_caching]
        for name in ("num_seqs", "prompt_len", "steps", "reps", "warmup", "max_model_len", "max_num_batched_tokens",
                     "torch_threads", "seed"):
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
        env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1)

    def ask(self, command: str | None, tag: str):
        """Send command (if any), return the value of the next `tag` line."""
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        self.proc.wait()
        self.stderr.seek(0)
        sys.stderr.write(self.stderr.read()[-6000:])
        raise RuntimeError(f"the {self.side} side ({self.rev}) exited with code {self.proc.returncode} "
                           f"before answering {tag}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def measure(args, srcs: dict[str, tuple[str, str]], model: str, prefix_caching: str) -> list[dict]:
    """Both sides started side by side, then their windows interleaved (before, after, after, before, ...)
    so the machine's drift (other processes, frequency) lands on both alike."""
    children = [Child(args, side, rev, src, model, prefix_caching) for side, (rev, src) in srcs.items()]
    try:
        for child in children:
            child.ask(None, "READY")
        for command, tag in (("window", "WINDOW"), ("argmax", "ARGMAX")):
            for rep in range(args.reps):
                for child in (children if rep % 2 == 0 else children[::-1]):
                    child.ask(command, tag)
        rows = [child.ask("done", "RESULT") for child in children]
    finally:
        for child in children:
            child.close()
    for row in rows:
        ms, cpu = row["ms_per_step"], row["cpu_ms_per_step"]
        row.update(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms),
                   cpu_median_ms=statistics.median(cpu), cpu_min_ms=min(cpu), cpu_max_ms=max(cpu),
                   argmax_median_ms=statistics.median(row["argmax_ms"]),
                   argmax_cpu_median_ms=statistics.median(row["argmax_cpu_ms"]))
        print(f"  {row['side']:<6} {row['rev']:<14} prefix caching {prefix_caching:<3}: "
              f"{row['median_ms']:.2f} ms/step (start-up {row['startup_s']:.1f} s, "
              f"prefill {row['prefill_s']:.1f} s in {row['num_prefill_steps']} steps; kvfit from "
              f"{os.path.dirname(row['kvfit_file'])})", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    header = (f"{'prefix caching':<15} {'side':<7} {'rev':<14} {'wall median':>11} {'min':>7} {'max':>7} "
              f"{'spread':>7} {'cpu median':>11} {'spread':>7} {'argmax cpu':>11} {'cpu - argmax':>13}")
    print()
    print("ms per decode step (engine.step(stream=True)) over the timed windows; wall: time.perf_counter, "
          "cpu: time.process_time of the side's process (what other processes on the machine do not add to)")
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = (row["max_ms"] - row["min_ms"]) / row["median_ms"]
        cpu_spread = (row["cpu_max_ms"] - row["cpu_min_ms"]) / row["cpu_median_ms"]
        print(f"{row['prefix_caching']:<15} {row['side']:<7} {row['rev']:<14} {row['median_ms']:>11.2f} "
              f"{row['min_ms']:>7.2f} {row['max_ms']:>7.2f} {spread:>7.1%} {row['cpu_median_ms']:>11.2f} "
              f"{cpu_spread:>7.1%} {row['argmax_cpu_median_ms']:>11.2f} "
              f"{row['cpu_median_ms'] - row['argmax_cpu_median_ms']:>13.2f}")
    print()
    print("before/after (> 1: after is faster), ratio of the medians; windows: the range of the paired windows' ratios")
    for prefix_caching in dict.fromkeys(row["prefix_caching"] for row in rows):
        by_side = {row["side"]: row for row in rows if row["prefix_caching"] == prefix_caching}
        before, after = by_side["before"], by_side["after"]
        parts = []
        for label, key, argmax_key in (("wall", "ms_per_step", None), ("cpu", "cpu_ms_per_step", None),
                                       ("cpu less the argmax", "cpu_ms_per_step", "argmax_cpu_median_ms")):
            b = statistics.median(before[key]) - (before[argmax_key] if argmax_key else 0.0)
            a = statistics.median(after[key]) - (after[argmax_key] if argmax_key else 0.0)
            text = f"{label} {b / a:.2f}x ({b:.2f} -> {a:.2f} ms"
            if argmax_key is None:
                paired = [x / y for x, y in zip(before[key], after[key])]
                text += f"; windows {min(paired):.2f}x..{max(paired):.2f}x"
            parts.append(text + ")")
        print(f"  prefix caching {prefix_caching:<3}: " + ", ".join(parts))


def run_parent(args) -> int:
    ref_rev = git("rev-parse", "--short", args.ref)
    if args.after:
        after_rev = git("rev-parse", "--short", args.after)
    else:
        dirty = bool(git("status", "--porcelain", "--", "src"))
        after_rev = git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    variants = ["off", "on"] if args.prefix_caching == "both" else [args.prefix_caching]
    print(f"bench_host_step: python {platform.python_version()} on {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, torch threads {args.torch_threads}; {args.num_seqs} sequences x "
          f"{args.prompt_len}-token prompts, {args.reps} windows of {args.steps} decode steps per side (interleaved) "
          f"after {args.warmup} warm-up; before = {ref_rev}, "
          f"after = {after_rev if args.after else f'this checkout ({after_rev})'}", flush=True)
    tmp = tempfile.mkdtemp(prefix="kvfit-host-step-")
    worktrees = {"before": (ref_rev, os.path.join(tmp, "before"))}
    if args.after:
        worktrees["after"] = (after_rev, os.path.join(tmp, "after"))
    rows: list[dict] = []
    try:
        for rev, folder in worktrees.values():
            git("worktree", "add", "--detach", folder, rev)
        srcs = {side: (rev, os.path.join(folder, "src")) for side, (rev, folder) in worktrees.items()}
        srcs.setdefault("after", (after_rev, os.path.join(REPO, "src")))
        model = make_model(os.path.join(tmp, "model"), args.max_model_len, args.seed)
        for prefix_caching in variants:
            rows += measure(args, srcs, model, prefix_caching)
    finally:
        for _, folder in worktrees.values():
            if os.path.isdir(folder):
                git("worktree", "remove", "--force", folder)
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"command": " ".join(sys.argv), "before": ref_rev, "after": after_rev,
                       "python": platform.python_version(), "cpus": os.cpu_count(), "runs": rows}, fh, indent=1)
            fh.write("\n")
        print(f"raw results: {args.out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=DEFAULT_REF, help="git revision of the 'before' engine")
    ap.add_argument("--after", help="git revision of the 'after' engine (default: this checkout's working tree)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=25, help="decode steps per timed window")
    ap.add_argument("--reps", type=int, default=7, help="timed windows per side")
    ap.add_argument("--warmup", type=int, default=5, help="decode steps before the first window")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--prefix-caching", choices=("off", "on", "both"), default="both")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads in each side (1: the argmax does not fight the host loop)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the raw JSON of every run here (e.g. under benchmarks/results/)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--rev", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    # the first requests prefilled also decode during the other prefill steps: leave them room
    if args.prompt_len + args.warmup + args.reps * args.steps + 128 > args.max_model_len:
        ap.error(f"--prompt-len + --warmup + --reps x --steps + 128 must fit --max-model-len {args.max_model_len}")
    if not args.child:
        return run_parent(args)
    if args.prefix_caching == "both":
        ap.error("a child runs one --prefix-caching setting, on or off")
    serve_child(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
